"""What several test modules share: no test module imports another.

reference.py   random paged batches and the float64 reference attention, written without the library's code
cases.py       batches per mode and the fp8 conformance cases
bad_inputs.py  the bad arguments and metadata values of the ops, each with the words of its error
models.py      PROMPTS and NEW_TOKENS, small named models, tiny configs of any causal LM, greedy reference tokens
scripts.py     the repository's paths and scripts run in a process of their own
"""
