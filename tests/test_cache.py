"""The compile cache (NOTE: [Compile cache] in fbmt/compiler/cache.py): a later run loads the program
an earlier one compiled, identical and computing the same; any change of what decides the program
misses; a broken entry is never loaded; the ranks agree on hit or miss."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.compiler import cache
from fbmt.compiler.program import format_graph
from fbmt.models.gpt import GPT, GPTConfig
from tests.dist import run_ranks
from tests.models import hf


def _gpt(d_model: int = 32, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, d_model=d_model, n_head=2))


def _trace(folder: Path, model: nn.Module | None = None, **options):
    """A program of a 2-rank model traced in this process (nothing runs), with the cache in `folder`."""
    compiled = fbmt.compile(model or _gpt(), world_size=2, device="meta", cache_dir=folder, **options)
    return compiled.trace(torch.zeros(2, 16, dtype=torch.long), device="cpu")


def test_a_second_compile_loads_the_identical_program(tmp_path):
    first = _trace(tmp_path)
    assert first.origin.startswith("compiled") and "saved to the compile cache" in first.origin
    second = _trace(tmp_path)
    assert second.origin.startswith("loaded from the compile cache"), second.origin
    assert format_graph(second) == format_graph(first)
    assert [r.summary for r in second.history] == [r.summary for r in first.history]
    assert second.collective_signature() == first.collective_signature()
    assert "# loaded from the compile cache" in str(second)


def _scaled_by(scale: float):
    return lambda module, inputs, output: output * scale


@pytest.mark.parametrize(
    "change",
    [
        "option",
        "world size",
        "model shape",
        "model attribute",
        "a hook's captured value",
        "torch version",
        "torch setting",
        "input shape",
        "fbmt's code",
    ],
)
def test_each_kind_of_change_misses_and_says_why(tmp_path, monkeypatch, caplog, change):
    hooked = change == "a hook's captured value"
    first = _gpt()
    if hooked:
        first.h[0].register_forward_hook(_scaled_by(2.0))
    _trace(tmp_path, first)
    model, options, seq = _gpt(), {}, 16
    if change == "option":
        options = dict(remat="none")
    elif change == "world size":
        options = dict(world_size=4)
    elif change == "model shape":
        model = _gpt(d_model=48)
    elif change == "model attribute":
        model.h[0].attn.n_head = 4  # no parameter changes shape, the program does
    elif hooked:  # the same hook's code, another value in its closure
        model.h[0].register_forward_hook(_scaled_by(3.0))
    elif change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".patched")
    elif change == "input shape":
        seq = 8
    elif change == "torch setting":  # which attention kernels a trace may choose
        flash = torch.backends.cuda.flash_sdp_enabled()
        torch.backends.cuda.enable_flash_sdp(not flash)
    elif change == "fbmt's code":
        monkeypatch.setattr(cache, "_fbmt_digest", lambda: "an edited fbmt")
    compiled = fbmt.compile(model, device="meta", cache_dir=tmp_path, **{"world_size": 2, **options})
    try:
        with caplog.at_level(logging.INFO, logger="fbmt"):
            program = compiled.trace(torch.zeros(2, seq, dtype=torch.long), device="cpu")
    finally:
        if change == "torch setting":
            torch.backends.cuda.enable_flash_sdp(flash)
    assert program.origin.startswith("compiled"), (change, program.origin)
    said = {
        "option": "the options",
        "world size": "its flat groups or world size",
        "model shape": "its modules",
        "model attribute": "its modules",
        "a hook's captured value": "its modules",
        "torch version": "fbmt, torch or transformers",
        "input shape": "the call's inputs",
        "torch setting": "torch's settings",
        "fbmt's code": "fbmt, torch or transformers",
    }[change]
    assert f"differs in {said}" in caplog.text or said in caplog.text, caplog.text


MODEL_FILE = """
import torch, torch.nn as nn

def act(x):
    return torch.{fn}(x)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = act(layer(x))
        return x.sum()
"""


def test_an_edited_model_file_misses(tmp_path, monkeypatch, caplog):
    """The user's source (a helper called through the module's globals included) is part of the key."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def program(fn: str):
        (tmp_path / "usernet.py").write_text(MODEL_FILE.format(fn=fn))
        sys.modules.pop("usernet", None)
        import usernet

        compiled = fbmt.compile(usernet.Net(), world_size=2, device="meta", cache_dir=tmp_path / "cache")
        return compiled.trace(torch.zeros(4, 8), device="cpu")

    first = program("relu")
    assert program("relu").origin.startswith("loaded")
    with caplog.at_level(logging.INFO, logger="fbmt"):
        edited = program("tanh")
    assert "its code (Python modules usernet)" in caplog.text, caplog.text
    assert edited.origin.startswith("compiled") and "tanh" in format_graph(edited) and "tanh" not in format_graph(first)


PROCESS = """
import sys, torch, fbmt
sys.path.insert(0, {folder!r})
import usernet
from tests.models import hf
for model, x in ((usernet.Net(), (torch.zeros(4, 8),)), (hf.build("llama"), (torch.zeros(2, 8, dtype=torch.long),))):
    compiled = fbmt.compile(model, world_size=2, device="meta", cache_dir={folder!r} + "/cache")
    print(compiled.trace(*x, device="cpu").origin.split(" ")[0])
"""


def test_another_process_with_other_string_hashes_loads_the_entry(tmp_path):
    """Keys are the same in every process: Python salts str hashes per process, so a set literal in the
    model's code (its constants) or a value a library draws at import must not enter the key."""
    code = MODEL_FILE.format(fn="relu").replace("return x.sum()", 'return x.sum() if "a" in {"a", "b", "c"} else x')
    (tmp_path / "usernet.py").write_text(code)
    root = str(Path(fbmt.__file__).parents[1])

    def run(seed: str) -> list[str]:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        done = subprocess.run(
            [sys.executable, "-c", PROCESS.format(folder=str(tmp_path))],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert run("1") == ["compiled", "compiled"]
    assert run("2") == ["loaded", "loaded"]


def test_a_broken_entry_is_never_loaded(tmp_path, caplog):
    _trace(tmp_path)
    (entry,) = cache.entries(tmp_path)
    for damage in ("flip a byte", "cut short", "no program", "garbled about"):
        pkl, about = entry.path / "program.pkl", entry.path / "about.json"
        if damage == "flip a byte":
            data = bytearray(pkl.read_bytes())
            data[len(data) // 2] ^= 0x10
            pkl.write_bytes(bytes(data))
        elif damage == "cut short":
            pkl.write_bytes(pkl.read_bytes()[:100])
        elif damage == "no program":
            pkl.unlink()
        else:
            about.write_text("{not json")
        with caplog.at_level(logging.WARNING, logger="fbmt"):
            caplog.clear()
            program = _trace(tmp_path)
        assert program.origin.startswith("compiled"), damage
        assert "is broken" in caplog.text and "compiling instead" in caplog.text, damage
        assert _trace(tmp_path).origin.startswith("loaded"), damage  # compiled again, saved again


def test_a_model_with_no_stable_description_compiles_every_time(tmp_path, caplog):
    model = _gpt()
    model.h[0].tool = object()  # "<object object at 0x...>": nothing to tell one process's from another's
    with caplog.at_level(logging.INFO, logger="fbmt"):
        program = _trace(tmp_path, model)
    assert program.origin.startswith("compiled") and "saved" not in program.origin
    assert "compiled every time" in caplog.text and "h.0.tool" in caplog.text
    assert cache.entries(tmp_path) == []


def test_cache_dir_false_and_the_variable_turn_it_off(tmp_path, monkeypatch):
    _trace(tmp_path)
    program = fbmt.compile(_gpt(), world_size=2, device="meta", cache_dir=False).trace(
        torch.zeros(2, 16, dtype=torch.long), device="cpu"
    )
    assert program.origin.startswith("compiled") and "saved" not in program.origin
    monkeypatch.setenv("FBMT_CACHE_DIR", "off")
    assert cache.default_dir() is None
    monkeypatch.setenv("FBMT_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache.default_dir() == tmp_path / "elsewhere"


def _train(rank: int, world: int, folders: list[str], steps: int = 2) -> dict:
    torch.manual_seed(0)
    model = hf.build("llama")
    compiled = fbmt.compile(model, cache_dir=folders[rank])
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        out = compiled(**fbmt.local_part(hf.inputs("llama", step)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return {
        "origin": compiled.program.origin,
        "text": format_graph(compiled.program),
        "losses": losses,
        "params": compiled.full_parameters(),
    }


def _eager(steps: int = 2) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = hf.build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        out = model(**hf.inputs("llama", step))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses, dict(model.named_parameters())


def test_on_two_ranks_a_loaded_program_trains_as_the_compiled_one_and_as_eager(tmp_path):
    folders = [str(tmp_path)] * 2
    cold = run_ranks(2, _train, folders)
    warm = run_ranks(2, _train, folders)
    assert all(r["origin"].startswith("compiled") for r in cold)
    assert all(r["origin"].startswith("loaded") for r in warm), [r["origin"] for r in warm]
    assert warm[0]["text"] == cold[0]["text"]
    assert warm[0]["losses"] == cold[0]["losses"]
    for name, p in cold[0]["params"].items():
        assert torch.equal(warm[0]["params"][name], p), name
    losses, params = _eager()
    both = (torch.tensor(warm[0]["losses"]) + torch.tensor(warm[1]["losses"])) / 2  # each rank's half of the batch
    torch.testing.assert_close(both, torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for name, p in params.items():
        if name in warm[0]["params"]:
            torch.testing.assert_close(warm[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_rank_that_loads_and_one_that_compiles_train_alike(tmp_path):
    """Rank 0 finds its entry, rank 1 (another machine's disk) has none: rank 0 loads, rank 1 compiles the
    same program, the per-call agreement passes, and they train as a cold run did."""
    warm, empty = tmp_path / "warm", tmp_path / "empty"
    first = run_ranks(2, _train, [str(warm)] * 2, 1)
    results = run_ranks(2, _train, [str(warm), str(empty)], 1)
    assert results[0]["origin"].startswith("loaded") and results[1]["origin"].startswith("compiled")
    assert results[0]["text"] == results[1]["text"]
    assert [r["losses"] for r in results] == [r["losses"] for r in first]


LENGTHS = [16, 24, 40, 128, 57]  # a program for 16, a symbolic one (traced at 24) for the rest


def _train_lengths(rank: int, world: int, folder: str | list[str], lengths: list[int] = LENGTHS) -> dict:
    torch.manual_seed(0)
    folder = folder[rank] if isinstance(folder, list) else folder
    model = fbmt.compile(GPT(GPTConfig(vocab_size=64, seq_len=128, n_layer=2, d_model=16, n_head=2)), cache_dir=folder)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, length in enumerate(lengths):
        tokens = torch.randint(0, 64, (4, length + 1), generator=torch.Generator().manual_seed(step))
        x, y = tokens[2 * rank : 2 * rank + 2, :-1], tokens[2 * rank : 2 * rank + 2, 1:]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    (symbolic,) = [p for p in model.programs.values() if p.sizes is not None]
    return {
        "origins": [p.origin for p in model.programs.values()],
        "texts": [format_graph(p) for p in model.programs.values()],
        "assumes": str(symbolic.sizes),
        "admits": [  # views as the training inputs are (stride: length + 1), and a contiguous one
            symbolic.sizes.admits([x])
            for x in [torch.zeros(2, n + 1)[:, :-1] for n in (1, 100, 128, 129)] + [torch.zeros(2, 100)]
        ],
        "losses": losses,
        "params": model.full_parameters(),
    }


def test_a_symbolic_program_is_kept_and_a_warm_run_loads_it_with_what_it_assumes(tmp_path):
    """NOTE: [Symbolic programs on disk]: the warm run compiles nothing, its programs and what the
    symbolic one assumes are the cold run's, it refuses the sizes the compiled one refused, and it
    trains exactly as the cold run did, which trained as eager."""
    cold = run_ranks(2, _train_lengths, str(tmp_path))
    warm = run_ranks(2, _train_lengths, str(tmp_path))
    assert all(o.startswith("compiled") for r in cold for o in r["origins"]), cold[0]["origins"]
    assert all("saved to the compile cache" in o for o in cold[0]["origins"]), cold[0]["origins"]  # rank 0 writes
    assert all(o.startswith("loaded") for r in warm for o in r["origins"]), warm[0]["origins"]
    for c, w in zip(cold, warm):
        assert w["texts"] == c["texts"] and w["assumes"] == c["assumes"] and w["admits"] == c["admits"]
        assert w["losses"] == c["losses"]
        for name, p in c["params"].items():
            assert torch.equal(w["params"][name], p), name
    # traced at 24, it admits at most 128 (NOTE: [Dynamic sizes]), and a loaded program too
    assert [a is None for a in warm[0]["admits"]] == [False, True, True, False, False], warm[0]["admits"]
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, seq_len=128, n_layer=2, d_model=16, n_head=2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, length in enumerate(LENGTHS):
        tokens = torch.randint(0, 64, (4, length + 1), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        both = (warm[0]["losses"][step] + warm[1]["losses"][step]) / 2
        assert abs(both - loss.item()) < 1e-4 * abs(loss.item()), (length, both, loss.item())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(warm[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_loaded_program_whose_trace_fixed_the_size_still_says_where(tmp_path, caplog):
    from tests.test_dynamic import UsesSize

    for run in ("cold", "warm"):
        model = fbmt.compile(UsesSize("tensor of the size"), world_size=1, cache_dir=tmp_path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fbmt"):
            for length in (8, 12, 16):
                model(torch.randn(2, length, 4))
        assert all(p.origin.startswith("compiled" if run == "cold" else "loaded") for p in model.programs.values())
        said = [r.getMessage() for r in caplog.records if "fixes the size that varies" in r.getMessage()]
        assert len(said) == 1 and "test_dynamic.py" in said[0] and "torch.tensor(T" in said[0], (run, said)


def test_the_command_lists_sizes_and_clears(tmp_path):
    _trace(tmp_path)
    _trace(tmp_path, remat="none")

    def cli(*args: str) -> str:
        env = {**os.environ, "PYTHONPATH": str(Path(fbmt.__file__).parents[1])}
        done = subprocess.run(
            [sys.executable, "-m", "fbmt.cache", *args, "--dir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listed = cli("list")
    assert listed.count("fbmt.models.gpt.GPT") == 2 and "2 entries" in listed, listed
    sized = cli("size")
    assert "KiB" in sized or "MiB" in sized, sized
    assert "cleared 2 entries" in cli("clear")
    assert cache.entries(tmp_path) == [] and "0 entries" in cli("list")


def test_inductor_artifacts_are_loaded_only_where_their_checksum_holds(tmp_path, monkeypatch, caplog):
    """torch's cache artifacts are compiled code: a damaged blob is never handed to torch."""
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled regions", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for entry in (good, bad):
        entry.mkdir()
        cache.save_artifacts(entry, compiling=0)
    (bad / "inductor.bin").write_bytes(b"compiled regionz")
    cache.load_artifacts.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fbmt"):
        cache.load_artifacts(good)
        cache.load_artifacts(bad)
    assert loaded == [b"compiled regions"]
    assert "do not match their checksum" in caplog.text


def test_inductor_artifacts_saved_as_regions_come_in_all_load(tmp_path, monkeypatch):
    """A model saves torch's artifacts each time regions come in; the entry then holds every region's,
    not only those of the last save (NOTE: [Artifacts saved more than once]), and a later run's save
    keeps what the entry held: a machine given the entry finds them all."""
    from torch.compiler._cache import CacheArtifactManager

    CacheArtifactManager._ensure_cache_artifacts_registered()  # as a compile would have
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # where loading writes them
    entry = tmp_path / "entry"
    entry.mkdir()

    def compiled(key: str) -> None:  # what Inductor's FX graph cache records of a region it compiled
        region = types.SimpleNamespace(key=key, _triton_bundle=None)  # its kernels: none to write out
        CacheArtifactManager.record_artifact("inductor", key, pickle.dumps(region))

    def saved(compiling: int = 3) -> set[str]:  # the regions a machine given the entry finds
        cache.save_artifacts(entry, compiling)
        info = torch.compiler.load_cache_artifacts((entry / "inductor.bin").read_bytes())
        return set(info.inductor_artifacts)

    compiled("fexp0fbmt0test0region0one")
    first = saved()
    compiled("fcos0fbmt0test0region0two")
    second = saved()
    assert "fexp0fbmt0test0region0one" in first and first | {"fcos0fbmt0test0region0two"} <= second, (first, second)
    assert cache.artifacts_missing(entry) == 3  # regions were compiling when it saved
    assert saved(compiling=0) == second and cache.artifacts_missing(entry) == 0
    with CacheArtifactManager.with_fresh_cache():  # another run, which compiled another region alone
        compiled("fsin0fbmt0test0region0three")
        assert saved() == second | {"fsin0fbmt0test0region0three"}
    assert cache.artifacts_missing(entry) == 0  # what the first run compiled is still there


def test_the_list_says_what_an_entry_holds_of_inductors_regions(tmp_path, monkeypatch, capsys):
    import fbmt.cache as command

    _trace(tmp_path)
    (entry,) = cache.entries(tmp_path)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled regions", None))
    listed = []
    for compiling in (None, 3, 0):
        if compiling is not None:
            cache.save_artifacts(entry.path, compiling)
        command.main(["list", "--dir", str(tmp_path)])
        listed.append(capsys.readouterr().out.splitlines()[0])
    assert "Inductor" not in listed[0], listed
    assert listed[1].endswith("with Inductor's regions (not 3 that were compiling)"), listed
    assert listed[2].endswith("with Inductor's regions, all"), listed


SCALED_FILE = """
import torch, torch.nn as nn

SCALE = [{scale}]  # a list, as configuration often is

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * SCALE[0]
        return x.sum()
"""


def test_a_changed_global_value_of_the_users_code_misses(tmp_path, monkeypatch):
    """A forward that reads a module-level value bakes it into the program: another value, from an edited
    file, must not load the program with the old one."""
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def run(scale: float):
        (tmp_path / "scalednet.py").write_text(SCALED_FILE.format(scale=scale))
        sys.modules.pop("scalednet", None)
        import scalednet

        torch.manual_seed(0)
        ref = scalednet.Net()
        model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=tmp_path / "cache")
        torch.testing.assert_close(model(x), ref(x))
        return model.program.origin

    assert run(2.0).startswith("compiled")
    assert run(2.0).startswith("loaded")
    assert run(3.0).startswith("compiled")


def test_a_warm_run_that_starts_at_another_length_runs_the_familys_symbolic_program(tmp_path):
    """NOTE: [A family's program on disk]: the cold run's symbolic program is found by the warm run's first
    call, whatever its length, so the warm run compiles nothing and runs one program; where one rank's disk
    lacks it (another machine), that rank compiles the call's own program, the per-call agreement finds the
    same collectives, and both ranks train as the warm run did."""
    run_ranks(2, _train_lengths, str(tmp_path))  # cold: a program for 16, a symbolic one for the rest
    other = [40, 24, 16, 128, 57]  # the rank without the cache: a symbolic program at 24, up to 128
    warm = run_ranks(2, _train_lengths, str(tmp_path), other)
    for r in warm:
        assert len(r["origins"]) == 1 and r["origins"][0].startswith("loaded"), r["origins"]
    alone = run_ranks(2, _train_lengths, [str(tmp_path), str(tmp_path / "empty")], other)
    assert alone[0]["origins"][0].startswith("loaded") and alone[1]["origins"][0].startswith("compiled")
    for w, a in zip(warm, alone):
        torch.testing.assert_close(torch.tensor(w["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=1e-6)
