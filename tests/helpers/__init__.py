"""What the test modules import: no test module imports another.

reference.py            random paged batches and the float64 reference attention, written without the library's code
cases.py                batches per mode, the fp8 conformance cases, the Triton kernels launched with a target's tiles
bad_inputs.py           the bad arguments and metadata values of the ops, each with the words of its error
models.py               PROMPTS and NEW_TOKENS, named models, tiny configs of any causal LM, greedy reference tokens
scripts.py              the repository's paths and scripts run in a process of their own
serving.py              a hand-scheduled packed forward of a transformers model, checked against transformers' logits
state_reference.py      random batches over state slots, the state ops' float64 recurrences, a call checked against them
state_cases.py          the state ops' cases by name, valid calls and the bad inputs they must refuse
flashinfer_stand_in.py  FlashInfer's Python code on the CPU, PyTorch code in place of its compiled kernels
"""
