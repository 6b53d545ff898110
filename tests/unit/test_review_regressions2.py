"""Second review of the references-9 .. faults-5 changes: the cases their own tests left out.

* ``runtime._restart_store`` keyed each attempt's process group by ``TORCHELASTIC_RESTART_COUNT``. That count is
  the agent's own: with several torchrun agents (nodes) under c10d rendezvous a node whose ranks failed counts a
  restart, while a node restarted because another failed, or one that joins late, does not (torch:
  "membership changes do not count as retries"). Ranks on the two nodes then waited on different keys and never
  met (until the collective timeout). Several agents now start as torch does.
* ``elastic.agent_id`` was ``host:pid`` of torchrun. In a container both recur (a fixed pod or container name,
  torchrun as pid 1 or another fixed pid), so a new job's torchrun restart took an earlier job's checkpoint in
  the same folder as its own and resumed it, where it is meant to be refused. The agent's start time now goes
  with its pid.
"""
from __future__ import annotations

import pytest

from dstrain import elastic, runtime


def test_restart_store_leaves_several_agents_to_torch(monkeypatch):
    import torch.distributed as dist

    def no_store(*a, **k):
        raise AssertionError("a store keyed by this node's restart count was made for a multi-node job")
    monkeypatch.setattr(dist, "TCPStore", no_store)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # two nodes: this one restarted once, the other maybe not
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert runtime._restart_store() is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one agent: its count is every rank's
    with pytest.raises(AssertionError, match="restart count"):
        runtime._restart_store()


def test_a_recurring_host_and_pid_of_another_torchrun_is_another_job(monkeypatch, tmp_path):
    import json
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-master-0")
    monkeypatch.setattr(elastic.os, "getppid", lambda: 1)
    env = {"TORCHELASTIC_RESTART_COUNT": "1"}
    first = elastic.agent_id(env)  # (the earlier job's agent, at its own start time)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 5, "torchrun_agents": [first]}))
    # a new torchrun with the same host name and pid
    monkeypatch.setattr(elastic, "_start_time", lambda pid: "999999999", raising=False)
    assert not elastic.written_by_this_job(tmp_path, [elastic.agent_id(env)])


def test_sentencepiece_warm_start_targets_read_after_their_prompt_as_written():
    """``encode_continuation`` took the plain encoding whenever it decoded back to the text alone; a SentencePiece
    pre-tokenizer puts a ``▁`` in front and the decoder's Strip hides it there, so the target ``def f(x):`` was taught
    as `` def f(x):``: read after its prompt (``decode_continuation``, as completions now are) an unfenced program
    gains an indent (IndentationError) and a maths answer a space. Llama-2, Mistral, Gemma tokenizers."""
    from dstrain.trainers.policy_rl import supervised_batch
    from models.policy.tokenizer import decode_continuation, encode_prompt
    from tests.hf_checkpoints import build_sp_tokenizer

    tok = build_sp_tokenizer("bpe")
    prompt = "Write f.\n```python\n"
    for target in ("def f(x):\n    return x\n```", "42", " b)", "    return a"):
        _, labels = supervised_batch(tok, [prompt], [target])
        ids = [t for t in labels[0].tolist() if t != -100]
        assert decode_continuation(tok, encode_prompt(tok, prompt), ids) == target  # was " def f(x):...", " 42"


def test_a_master_addr_not_yet_in_dns_is_looked_up_again(monkeypatch):
    """``check_rank_env`` refused at the first lookup that found no such name, where torch's store client retried:
    a worker started before rank 0's DNS record exists (a Kubernetes headless service publishes a pod's record once
    the pod runs; JobSet, LeaderWorkerSet, Ray on Kubernetes) ended with exit 2 instead of joining seconds later."""
    import socket
    import time

    tries = []

    def resolve(host, port, *a, **k):
        tries.append(host)
        if len(tries) < 3:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port))]
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "job-master-0.job", "MASTER_PORT": "29500"}
    runtime.check_rank_env(env)  # was LaunchError "does not resolve here" at the first try
    assert len(tries) == 3
