"""Kernels: block attention over `[context; memory; block]` keys/values (the draft) and the routed
experts' grouped SwiGLU (a sparse target); `backend.target_backend` is the platform that picks their
implementations."""
