"""retrospec: orchestrator."""

import kernel_cache  # noqa: F401  (first: numba's cache of our kernels follows their imports)
