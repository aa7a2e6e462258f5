"""Shared by the launch tests (tests/launch/test_launch.py, tests/launch/test_launch_local.py,
tests/launch/test_launch_slurm_stub.py): a dataclass config with `resume` and a trivial job
function.

As in a notebook, the jobs cannot import this module: what it defines travels by value.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclasses.dataclass(kw_only=True)
class Cfg:
    out_dir: str
    n: int = 3
    resume: bool = False


def times_ten(x):
    return 10 * x
