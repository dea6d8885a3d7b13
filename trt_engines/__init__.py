"""retrospec: trt_engines.

`trt_engines.base` holds the `TargetEngine` protocol and its data types (no torch import);
`trt_engines.torch_engine.TorchEngine` is the PyTorch reference engine (imports torch);
`trt_engines.llama` the model, `trt_engines.kv_cache` the paged KV cache, `trt_engines.prepare` the default model.
"""

import kernel_cache  # noqa: F401  (first: numba's cache of our kernels follows their imports)
