"""zerostate.findings: the one decision of which checks a run fails, and the model-agreement projection
it uses."""
