"""`VLLMServer.attach`: a handle to a vLLM server started elsewhere, checked before use (the
served name and max_model_len from `GET /v1/models`, the dev-mode reload routes, a server on
this machine for the /dev/shm weight files), loaded with the policy's weights, and closed
without stopping the server.

Most tests attach to a stand-in server (tests/_vllm_fake.py) started here: it needs no vLLM
venv, and its controls make it answer as a server without the dev-mode routes would. Its
samples start with a digest of the weight files it reloaded last, so which weights it holds is
read from the samples, independently of the handle. One test attaches to the suite's shared
real server (`vllm_server`) and compares greedy tokens with the builtin `Policy.generate`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _policy_helpers import drawn_policy
from _vllm_fake import expected_ids, fake_venv, weights_digest

from posttrain.policy.policy import Policy
from posttrain.policy.rollout_engine import VLLMEngine
from posttrain.policy.vllm_attach import AttachRefused, is_this_machine
from posttrain.policy.vllm_process import VLLMServerError, group_alive
from posttrain.policy.vllm_server import VLLMServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A stand-in server started from drawn_policy(0), closed after the module."""
    folder = tmp_path_factory.mktemp("attach")
    venv = fake_venv(folder / "venv")
    with VLLMServer.start(drawn_policy(0), folder / "run", venv=str(venv)) as server:
        yield server


def first_token(server: VLLMServer, prompt: list[int]) -> int:
    [sample] = server.generate([prompt], temperature=0.0, max_new_tokens=2, seed=0)
    return sample.token_ids[0]


def test_attach_loads_the_policy_and_close_leaves_the_server_running(stand_in):
    prompt = [5, 6, 7]
    stand_in.sync_weights(drawn_policy(0))
    before = first_token(stand_in, prompt)
    attached = VLLMServer.attach(stand_in.url + "/", drawn_policy(1))
    weights = Path(attached._shm_dir) / "weights"
    digest = weights_digest(weights)  # the files the server was told to reload
    assert attached.attached and attached.pgid is None and attached.weight_version == 0
    assert attached.url == stand_in.url and attached.alive
    [sample] = attached.generate([prompt], temperature=0.0, max_new_tokens=3, seed=0)
    assert sample.token_ids == expected_ids(prompt, 0, 0.0, 3, digest)
    assert sample.weight_version == 0 and sample.token_ids[0] != before
    attached.close()
    assert not weights.exists() and not attached.alive
    assert stand_in.alive and group_alive(stand_in.pgid)  # the server it did not start
    with pytest.raises(VLLMServerError, match="closed"):
        attached.generate([prompt], max_new_tokens=1)
    stand_in.sync_weights(drawn_policy(0))  # the handle that started it still syncs
    assert first_token(stand_in, prompt) == before


def test_the_vllm_engine_attaches_with_url_and_its_close_leaves_the_server(stand_in):
    with VLLMEngine.start(drawn_policy(1), "unused", version=4, url=stand_in.url) as engine:
        assert engine.version == 4 and engine.server.attached
        assert engine.sync(drawn_policy(0)) == 5
        assert engine.generate([[1, 2]], max_new_tokens=1, seed=0)[0].weight_version == 5
    assert stand_in.alive and group_alive(stand_in.pgid)


def test_attach_refuses_a_server_it_cannot_use_by_name(stand_in, tmp_path):
    policy = drawn_policy(0)
    with pytest.raises(AttachRefused, match="--served-model-name other"):
        VLLMServer.attach(stand_in.url, policy, served_name="other")
    longer = dataclasses.replace(policy.spec, max_seq_len=policy.spec.max_seq_len * 2)
    with pytest.raises(AttachRefused, match=f"--max-model-len {longer.max_seq_len}"):
        VLLMServer.attach(stand_in.url, Policy(policy.model, policy.tokenizer, longer))
    control = stand_in.log_path.parent / "no_dev_mode"
    control.touch()
    try:
        with pytest.raises(AttachRefused, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMServer.attach(stand_in.url, policy)
    finally:
        control.unlink()
    # 192.0.2.0/24 is reserved for documentation: no machine has it, and nothing is asked
    with pytest.raises(AttachRefused, match="another machine.*weights_dir="):
        VLLMServer.attach("http://192.0.2.1:8000", policy)
    with pytest.raises(ValueError, match="http://host:port"):
        VLLMServer.attach("ftp://127.0.0.1:8000", policy)
    with pytest.raises(AttachRefused, match="is a vLLM server running there"):
        VLLMServer.attach("http://127.0.0.1:9", policy, check_timeout_s=5.0)
    with pytest.raises(ValueError, match="dtype"):  # the policy refused before any request
        VLLMServer.attach("http://192.0.2.1:8000", Policy.from_spec("tiny-1m", dtype=torch.float64))


def test_this_machine_is_told_from_others():
    import socket

    assert is_this_machine("127.0.0.1") and is_this_machine("localhost")
    assert is_this_machine(socket.gethostname())
    assert not is_this_machine("192.0.2.1")
    assert not is_this_machine("no-such-host.invalid")


def test_attach_to_the_shared_real_server_samples_the_policy(vllm_server):
    """Greedy tokens of an attached handle equal the builtin `Policy.generate`'s (the server
    holds the attached policy's weights); closing it leaves the shared server serving."""
    policy = drawn_policy(1)
    prompts = ["12+3=", "a longer prompt of a few words"]
    attached = VLLMServer.attach(vllm_server.url, policy)
    try:
        served = attached.generate(prompts, temperature=0.0, max_new_tokens=6, seed=0)
    finally:
        attached.close()
    builtin = policy.generate(prompts, temperature=0.0, max_new_tokens=6, seed=0)
    assert [list(c.token_ids) for c in served] == [list(c.token_ids) for c in builtin]
    assert vllm_server.alive
    vllm_server.sync_weights(drawn_policy(0))  # its starting weights back (the contract: any)
