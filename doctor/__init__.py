"""``zerostate doctor``: which known DeepSpeed issues a training setup is in the family of, before it runs.

`read_inputs` reads a DeepSpeed config, trainer arguments and an accelerate config into a `setup.Setup`;
`diagnose` judges it against the known-issue table through the `dimensions` every repro is read on; `render`
prints the diagnosis.  Pure Python: no torch, no DeepSpeed (``--replay`` runs the repros through the targets)."""

from zerostate.doctor.diagnose import Diagnosis, diagnose
from zerostate.doctor.read_inputs import read_setup
from zerostate.doctor.setup import DoctorError, Fact, Setup

__all__ = ["Diagnosis", "DoctorError", "Fact", "Setup", "diagnose", "read_setup"]
