import os

# Triton kernels run on the CPU through the interpreter; it must be on before a kernel is decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
