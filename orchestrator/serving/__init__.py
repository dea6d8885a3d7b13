"""Serving front ends over one shared orchestrator: Triton Inference Server models (`triton_server`), an
OpenAI-compatible HTTP API (`http_api`), Prometheus metrics (`metrics`) and a stock-Triton model repository
exporter (`triton_repo`). `stack.ServingStack` builds the shared engine + drafter + orchestrator + runner."""
