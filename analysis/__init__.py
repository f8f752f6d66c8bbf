"""zerostate.analysis: what is computed *over* the model and the specs -- the exhaustive check of designs
(`checker`, behind ``zerostate check``) and the side-by-side comparison of two designs (`compare`, behind
``zerostate compare``).

It sits above both: ``model`` (the state machines) imports nothing of the project, ``specs`` import the
model, and the analyses import the two.  Imports neither torch nor deepspeed.
"""
