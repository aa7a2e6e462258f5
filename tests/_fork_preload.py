"""What the fork server of `_ranks.start_script` imports once per test session, before it forks
any script: torch, torchtune, posttrain and verl (with ray, transformers and pandas, which verl
imports), ~6-10 s of CPU that a fresh interpreter would spend in every rank it starts.

Nothing here runs a torch operation or starts a thread pool (a fork after OpenMP has run can
hang the child's first parallel region). `ADDED_ENV` holds the variables these imports put into
`os.environ` (torch's TORCHINDUCTOR_CACHE_DIR, ray's RAY_CLIENT_MODE, ...): a fresh interpreter
would set them when it imports the same modules, so a forked script gets them too unless its
environment names them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_before = dict(os.environ)
FRESH_SYS_PATH: list[str] = json.loads(
    subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
)
"""`sys.path` of a fresh interpreter after its script's folder: a forked script gets this one,
not the test session's (which holds tests/ and the checkout), so its imports resolve as they
would in `python SCRIPT`."""

import torch  # noqa: E402
import torch.distributed  # noqa: E402, F401
import torchtune.models.llama3  # noqa: E402, F401
import torchtune.models.qwen2  # noqa: E402, F401
import torchtune.training  # noqa: E402, F401
import verl.trainer.config  # noqa: E402, F401
import verl.trainer.ppo.core_algos  # noqa: E402, F401
import verl.workers.config.actor  # noqa: E402, F401

import posttrain.data  # noqa: E402, F401
import posttrain.models  # noqa: E402, F401
import posttrain.policy  # noqa: E402, F401
import posttrain.preference  # noqa: E402, F401
import posttrain.rewards  # noqa: E402, F401
import posttrain.rl  # noqa: E402, F401
import posttrain.train  # noqa: E402, F401

ADDED_ENV = {k: v for k, v in os.environ.items() if _before.get(k) != v}
