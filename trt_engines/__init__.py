"""retrospec: trt_engines."""
