"""The names of the profiler ranges `capture` writes and the trace readers look for.

They are the contract between the two sides: `capture` brackets each step with `ProfilerStep#N` (HTA's step marker)
and `fusionscope.phase:<name>`, and each module call with `nn.Module: <path>`; `trace`, `ranks`, `apply.measure` and
`apply.replay` read them back. Kept here, below both, so that reading a trace does not load the code that runs a model.
"""

STEP_PREFIX = "ProfilerStep#"
PHASE_PREFIX = "fusionscope.phase:"
MODULE_PREFIX = "nn.Module: "
