"""grpo.checkpoint: nothing non-finite is saved, saves are durable (fsync around the rename), and a full disk
or a file-size limit during a save says so with the path. Tiny model built in code, CPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import tiny_config

from grpo import checkpoint
from grpo.atomic import write_atomically
from grpo.demo import build_model_and_tokenizer
from grpo.trainer import make_optimizer, prepare_model

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    model, _ = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight[3, 5] = math.inf
    path = checkpoint.path_in(cfg.output_dir)
    with pytest.raises(ValueError, match=r"non-finite.*lm_head\.weight"):
        checkpoint.save(path, 1, policy, None, make_optimizer(policy, cfg), {})
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_finite_check_finds_every_nan_and_inf_without_a_temporary_of_the_tensors_size(dtype):
    g = torch.Generator().manual_seed(0)
    clean = (torch.randn(3001, 7, generator=g) * 100).to(dtype)
    assert checkpoint.all_finite(clean) and checkpoint.all_finite(clean[:, ::3]) and checkpoint.all_finite(clean[:0])
    for bad in (math.nan, math.inf, -math.inf):
        for at in ((0, 0), (1777, 3), (3000, 6)):
            poisoned = clean.clone()
            poisoned[at] = bad
            assert not checkpoint.all_finite(poisoned), (bad, at)
            assert checkpoint.non_finite_tensors({"a": clean, "b": [clean, poisoned]}) == ["b.1"]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        checkpoint.all_finite(clean)
    allocated = sum(max(0, e.cpu_memory_usage) for e in prof.events())
    assert allocated < clean.nbytes // 8  # (isfinite().all(): more than nbytes)


def test_a_checkpoint_is_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", b)), real_replace(a, b)))
    model, _ = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    path = checkpoint.path_in(cfg.output_dir)
    checkpoint.save(path, 1, policy, None, make_optimizer(policy, cfg), {})
    assert events == [("fsync", False), ("replace", path), ("fsync", True)]  # the file, the rename, its directory


def test_a_full_disk_during_a_save_says_so_with_the_path(tmp_path):
    """/dev/full answers every write with ENOSPC: the checkpoint's temporary file is made a link to it
    (a real full device; torch.save alone reports "PytorchStreamWriter failed writing file")."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    model, _ = build_model_and_tokenizer(seed=0)
    path = str(tmp_path / "checkpoint.pt")
    write_atomically(path, lambda f: f.write(b"the previous checkpoint"))
    os.symlink("/dev/full", path + ".tmp")
    policy = prepare_model(model, tiny_config(tmp_path), torch.device("cpu"))
    with pytest.raises(OSError, match=rf"No space left on device: could not write {path}") as info:
        checkpoint.save(path, 1, policy, None, make_optimizer(policy, tiny_config(tmp_path)), {})
    assert info.value.errno == 28
    assert open(path, "rb").read() == b"the previous checkpoint" and not os.path.lexists(path + ".tmp")


def test_a_file_size_limit_during_a_save_says_so_with_the_path(tmp_path):
    """RLIMIT_FSIZE (a real kernel limit, in a child process) makes writes fail with EFBIG."""
    code = textwrap.dedent(f"""
        import importlib.util, resource, signal
        spec = importlib.util.spec_from_file_location("atomic", {os.path.join(ROOT, 'grpo', 'atomic.py')!r})
        atomic = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(atomic)  # (grpo.atomic alone: importing the package would load torch)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            atomic.write_atomically({str(tmp_path / 'checkpoint.pt')!r}, lambda f: [f.write(bytes(1000)) for _ in range(10)])
        except OSError as e:
            print("OSError", e.errno, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=300)
    assert f"File too large: could not write {tmp_path / 'checkpoint.pt'}" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not os.listdir(tmp_path)


# ---- reading a checkpoint to resume from: a refusal names the file; a foreign pickle runs nothing
class _Runs:
    """A pickle that would run code when unpickled (what weights_only refuses to do)."""

    def __reduce__(self):
        return (os.system, ("touch ran-on-load",))


def _saved(tmp_path, model=None):
    model = model or build_model_and_tokenizer(seed=0)[0]
    cfg = tiny_config(tmp_path)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    path = checkpoint.path_in(cfg.output_dir)
    checkpoint.save(path, 3, policy, None, make_optimizer(policy, cfg), {"seed": 0})
    return path, model


@pytest.mark.parametrize("content", [
    b"", b"garbage", "truncate", "pickle", "code", "list", "missing keys", "step", "weights", "optimizer", "frozen"])
def test_an_unusable_checkpoint_is_refused_naming_the_file(content, tmp_path, monkeypatch):
    import pickle

    path, _ = _saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    state = torch.load(path, weights_only=False)
    if isinstance(content, bytes):
        open(path, "wb").write(content)
    elif content == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif content == "pickle":
        pickle.dump(state["config"], open(path, "wb"))
    elif content == "code":
        torch.save({"step": 1, "x": _Runs()}, path)
    elif content == "list":
        torch.save([1, 2], path)
    else:
        broken = {"missing keys": lambda s: s.pop("optimizer"), "step": lambda s: s.update(step=-1),
                  "weights": lambda s: s.update(model={"a": 1.0}), "optimizer": lambda s: s.update(optimizer={"x": 1}),
                  "frozen": lambda s: s.update(frozen={"lm_head.weight": [5, True]})}
        broken[content](state)
        torch.save(state, path)
    with pytest.raises(checkpoint.CheckpointError, match=str(path)):
        checkpoint.read(path)
    assert not os.path.exists(tmp_path / "ran-on-load")


def test_a_checkpoint_reads_back_and_is_checked_against_the_model_before_it_changes(tmp_path):
    """read() gives save()'s state (memory-mapped, weights_only); check_resumable compares the weights'
    names and shapes with the caller's model as it is before the run casts it or adds LoRA layers,
    a LoRA run's peft names (base_model.model. ..., .base_layer, the adapters) mapped back."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    path, model = _saved(tmp_path)
    state = checkpoint.read(path)
    assert state["step"] == 3 and state["config"] == {"seed": 0}
    checkpoint.check_resumable(state, path, model, None)
    other = build_model_and_tokenizer(seed=0)[0]
    other.lm_head = torch.nn.Linear(64, 5, bias=False)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{path}.*another model.*lm_head"):
        checkpoint.check_resumable(state, path, other, None)
    with pytest.raises(ValueError, match=r"seed: 0 -> 1.*--resume-with-changes"):
        checkpoint.check_resumable(state, path, model, {"seed": 1})
    checkpoint.check_resumable(state, path, model, {"seed": 1}, allow_changes=True)
    plain = build_model_and_tokenizer(seed=0)[0]
    lora = get_peft_model(build_model_and_tokenizer(seed=0)[0], LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    lora_path = str(tmp_path / "lora.pt")
    torch.save({**state, "model": lora.state_dict()}, lora_path)
    checkpoint.check_resumable(checkpoint.read(lora_path), lora_path, plain, None)


def test_a_lora_checkpoint_leaves_the_frozen_base_out_and_resumes_against_it(tmp_path):
    """Under LoRA the checkpoint holds what trains (the adapters) and the base's names and shapes, never
    its weights (peft's checkpoints leave them out too; the resuming run's model holds them): a fresh
    LoRA model restores the adapters bit for bit, a base of another shape is refused by name, and a
    state that leaves out a weight it does not declare frozen is refused before anything loads."""
    pytest.importorskip("peft")
    from grpo import lora

    cfg = tiny_config(tmp_path, use_peft=True, lora_r=2)
    model = lora.add_adapters(build_model_and_tokenizer(seed=0)[0], cfg)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_()  # (B starts at zero: any value restored must be the saved one)
    trained = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    frozen = {n: list(p.shape) for n, p in policy.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert trained and frozen and all("lora_" in n for n in trained)
    path = checkpoint.path_in(cfg.output_dir)
    checkpoint.save(path, 2, policy, None, make_optimizer(policy, cfg), {})
    state = checkpoint.read(path)
    assert state["model"].keys() == trained.keys() and state["frozen"] == frozen
    frozen_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters() if not p.requires_grad)
    assert os.path.getsize(path) < frozen_bytes / 2  # (with the base in it, the file would be larger than the base)

    fresh_model = build_model_and_tokenizer(seed=0)[0]
    checkpoint.check_resumable(state, path, fresh_model, None)  # the plain model, before its adapters
    fresh = prepare_model(lora.add_adapters(fresh_model, cfg), cfg, torch.device("cpu"))
    fresh_opt = make_optimizer(fresh, cfg)
    assert checkpoint.restore(state, path, fresh, None, fresh_opt) == 2
    for n, p in fresh.model.named_parameters():
        if n in trained:
            assert torch.equal(p, trained[n]), n

    other = build_model_and_tokenizer(seed=0)[0]
    other.lm_head = torch.nn.Linear(64, 5, bias=False)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{path}.*another model.*lm_head"):
        checkpoint.check_resumable(state, path, other, None)
    name = next(iter(trained))
    before = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    for broken in ({**state, "model": {k: v for k, v in state["model"].items() if k != name}},
                   {**state, "frozen": {**state["frozen"], "not.a.weight": [1]}}):
        with pytest.raises(checkpoint.CheckpointError, match=rf"cannot resume from {path}.*does not fit"):
            checkpoint.restore(broken, path, fresh, None, fresh_opt)
    assert all(torch.equal(p, before[n]) for n, p in fresh.model.named_parameters())  # refused: nothing loaded


def test_the_lock_probe_creates_nothing_and_sees_a_live_run(tmp_path):
    out = tmp_path / "run"
    checkpoint.check_not_in_use(str(out))
    assert not out.exists()
    with checkpoint.RunLock(str(out)):
        with pytest.raises(checkpoint.OutputDirInUse, match=rf"{out} is in use .*pid {os.getpid()}"):
            checkpoint.check_not_in_use(str(out))
    checkpoint.check_not_in_use(str(out))  # (released: the file stays, the lock does not)
    with checkpoint.RunLock(str(out)):
        pass
