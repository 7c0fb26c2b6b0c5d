"""Every code block of README.md and of the documentation site (docs/**/*.md) is true: it
runs, as shown.

* A ``python`` or ``yaml`` block must be preceded by ``<!-- example: PATH -->`` and be a verbatim
  excerpt of ``PATH`` (consecutive lines, up to a common indentation); ``test_examples.py`` runs
  every file under ``examples/``.
* Every command of a ``bash`` block must be a key of :data:`COMMANDS`, which says how the test
  runs it (as written, or at toy sizes with extra arguments), or why it cannot run here (a cluster
  scheduler, an installation). A command that is added to the README without an entry here, or
  an entry whose command left the README, fails.
* The ``ci:`` blocks are the commands ``.ci/run`` extracts (CI runs the test command itself); the
  demo at the end of the main command runs here, and its printed tables must be the README's
  sample output.
* ``text`` blocks are output and trees, not code; any other fence language fails.
* A command may appear in any of those pages (it moved from the README into a guide); a
  ``COMMANDS`` entry that no page shows any more fails. The docs repeat the README's ``ci:``
  blocks (Getting started); they must be the README's, character for character.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable, Optional

import pytest

from tests.examples.test_examples import LLAMA_TINY, env, run
from tests.launch import (GLOO_EXIT_ABORT, free_port, launch_side_by_side,
                          once_more_after_exit_abort)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def doc_files() -> list[Path]:
    """The pages whose code blocks are checked: the README and every page of the docs site."""
    return [README] + sorted((ROOT / "docs").rglob("*.md"))


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    example: Optional[str]  # the <!-- example: PATH --> above it
    ci: bool  # inside <!-- ci:... --> markers


def blocks(path: Path = README) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i, ci = [], 0, False
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("<!-- ci:") and not stripped.startswith("<!-- /ci:"):
            ci = True
        elif stripped.startswith("<!-- /ci:"):
            ci = False
        if stripped.startswith("```"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            lang = stripped[3:].strip()
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            body = "\n".join(line[indent:] for line in lines[i + 1:j])
            prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = re.fullmatch(r"<!-- example: (\S+) -->", prev)
            out.append(Block(lang, body, i + 1, m.group(1) if m else None, ci))
            i = j
        i += 1
    return out


def commands(text: str) -> list[str]:
    """The shell commands of a bash block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def is_excerpt(snippet: str, text: str) -> bool:
    """``snippet``'s lines appear consecutively in ``text``, after removing a common indent."""
    want = textwrap.dedent(snippet).splitlines()
    have = text.splitlines()
    for start in range(len(have) - len(want) + 1):
        window = have[start:start + len(want)]
        if textwrap.dedent("\n".join(window)).splitlines() == want:
            return True
    return False


# -- how each README command runs -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Runs:
    """Run the command as written plus ``extra`` arguments; ``check(stdout, tmp_path)``."""
    extra: tuple[str, ...] = ()
    check: Optional[Callable[[str, Path], None]] = None


@dataclasses.dataclass(frozen=True)
class Custom:
    """Run ``fn(tmp_path)``: the command needs set-up or another shape on this machine."""
    fn: Callable[[Path], None]


@dataclasses.dataclass(frozen=True)
class NotHere:
    """Cannot run in the test suite, and why (what checks it instead)."""
    why: str


def _argv(command: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = command.split()
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return argv + list(extra)


def _sample_outputs() -> list[str]:
    """The demo's sample output, wherever a page shows it (at least once)."""
    samples = [b.text for path in doc_files() for b in blocks(path)
               if b.lang == "text" and "== How vescale_fsdp" in b.text]
    assert samples, "no page shows the demo's sample output"
    return samples


def _tables(text: str) -> list[str]:
    """The deterministic lines of the demo's report: the sharding table and the memory table
    (element counts, padding, granularities, tensor bytes)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("== How vescale_fsdp"))
    keep = []
    for line in lines[start:]:
        if line.startswith(("group ", "<root>", "model.", "total ", "KiB,", "parameters",
                            "gradients", "optimizer states", "== ")):
            keep.append(line.rstrip())
    return keep


def _demo(stdout: str, tmp_path: Path) -> None:
    assert "Epoch 0" in stdout  # Lightning's progress bar
    for sample in _sample_outputs():
        assert _tables(stdout) == _tables(sample), "the docs' sample output is stale"
    losses = re.findall(r"(vescale_fsdp|ddp) x2: loss (\S+) -> (\S+) in 60 steps, validation "
                        r"perplexity (\S+)", stdout)
    assert len(losses) == 2, stdout[-3000:]
    (_, a0, a1, ap), (_, b0, b1, bp) = losses
    assert float(a1) < float(a0) - 0.5  # the loss falls
    assert abs(float(a1) - float(b1)) <= 1e-3 and abs(float(ap) - float(bp)) <= 1e-3 * float(bp)
    # what the README says does not depend on the CPU: every step's loss against DDP's
    same = re.search(r"vescale_fsdp vs ddp: the losses of all 60 steps (bitwise equal|max "
                     r"\|difference\| (\S+))", stdout)
    assert same and (same[1] == "bitwise equal" or float(same[2]) <= 1e-3), stdout[-3000:]


def _consolidate(tmp_path: Path) -> None:
    run([sys.executable, "examples/train_gpt.py", "--no-ddp", "--max-steps", "2",
         "--val-every", "2", "--save", str(tmp_path / "gpt_ckpt")])
    command = "python -m lightning_vescale.consolidate /tmp/gpt_ckpt /tmp/gpt_full.ckpt"
    out = run(_argv(command.replace("/tmp/", f"{tmp_path}/")))
    assert "wrote full checkpoint" in out and (tmp_path / "gpt_full.ckpt").is_file()


def _run_once_more_after_exit_abort(argv: list[str], done: Callable[[str], bool]) -> str:
    """Run ``argv`` (stdout, then stderr); once more only after gloo's exit-time abort that came
    after ``done`` (its output) was complete (``tests/launch.py``)."""
    def start() -> tuple[list[int], list[str]]:
        proc = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=300)
        return [proc.returncode], [proc.stdout + "\n" + proc.stderr]

    return once_more_after_exit_abort(start, lambda outs: done(outs[0]))[0]


def _quantized_comm(tmp_path: Path) -> None:
    """The command at 3 steps (once more after an exit-time abort only)."""
    argv = _argv("torchrun --nproc-per-node 2 examples/quantized_comm.py",
                 ("--steps", "3", "--master-port", str(free_port())))
    argv = argv[:3] + argv[-2:] + argv[3:-2]  # --master-port is the launcher's option

    def done(out: str) -> bool:
        return ("quantized_comm: 2 process(es), int8" in out
                and "comm policy: all-gather int8" in out)

    out = _run_once_more_after_exit_abort(argv, done)
    assert done(out), out[-3000:]


def _two_nodes(tmp_path: Path) -> None:
    """The multi-node torchrun command as two one-process "nodes" on this machine (CPU, toy
    sizes): the same launcher flags, script and config, rendezvous over 127.0.0.1; once more
    only after an exit-time abort that came after the checkpoint was written."""
    ckpt = tmp_path / "out" / "checkpoints" / "llama" / "last.ckpt" / ".metadata"

    def start() -> tuple[list[int], list[str]]:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        port = str(free_port())
        return launch_side_by_side(
            [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
              "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
              "--master-port", port, str(ROOT / "examples/llama.py"), "fit", "--config",
              str(ROOT / "examples/configs/llama_8gpu_multinode.yaml"), *LLAMA_TINY,
              "--trainer.num_nodes=2", "--trainer.devices=1"] for node in (0, 1)],
            cwd=tmp_path, env=env(), timeout=300)

    once_more_after_exit_abort(start, lambda outs: ckpt.is_file())
    assert ckpt.is_file()
    assert {p.name for p in tmp_path.iterdir()} == {"out"}  # Lightning's logs under out/ too


def _fit_reached_max_steps(out: str, _: Path) -> bool:
    return "`Trainer.fit` stopped: `max_steps=4` reached." in out


COMMANDS: dict[str, object] = {
    "python examples/train_gpt.py": Runs(check=_demo),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        NotHere("an installation from the network; CI installs torch with the ci:test-command"),
    "pip install -e '.[docs]'":
        NotHere("an installation; CI installs the [docs] extra with the ci:test-command"),
    "python examples/cli.py fit --config examples/configs/gpt_vescale.yaml "
    "--trainer.strategy.init_args.reshard_after_forward=false":
        Runs(extra=("--trainer.max_steps=4", "--trainer.enable_progress_bar=false"),
             check=_fit_reached_max_steps),
    "python examples/cli.py fit --config examples/configs/gpt_vescale.yaml "
    "--config examples/configs/muon.yaml":
        Runs(extra=("--trainer.max_steps=4", "--trainer.enable_progress_bar=false"),
             check=_fit_reached_max_steps),
    "torchrun --nproc-per-node 2 examples/fully_shard_torchrun.py":
        Runs(extra=("--steps", "3"), check=lambda out, _: "fully_shard: 2 process(es)" in out),
    "torchrun --nproc-per-node 2 examples/quantized_comm.py": Custom(_quantized_comm),
    "torchrun --nproc-per-node 4 examples/fully_shard_torchrun.py --replicas 2":
        Runs(extra=("--steps", "3"),
             check=lambda out, _: "fully_shard: 4 process(es), HSDP (2, 2)" in out),
    "python -m lightning_vescale.consolidate /tmp/gpt_ckpt /tmp/gpt_full.ckpt": Custom(_consolidate),
    "torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
    "--master-port 29500 examples/llama.py fit --config "
    "examples/configs/llama_8gpu_multinode.yaml": Custom(_two_nodes),
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
    "--master-port 29500 examples/llama.py fit --config examples/configs/hsdp_llama_2x8gpu.yaml":
        NotHere("needs 16 GPUs; tests/lightning/test_hsdp_strategy.py parses the config and "
                "test_hsdp_multinode.py runs HSDP on two torchrun nodes"),
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
    "--master-port 29500 examples/llama.py fit --config examples/configs/tp_llama_2x8gpu.yaml":
        NotHere("needs 16 GPUs; test_examples.test_tp_llama_config_runs_tiny_on_cpu runs the "
                "config at (dp 2, tp 2) on 4 CPU ranks"),
    "sbatch examples/slurm_hsdp_2x8.sbatch":
        NotHere("needs a SLURM cluster; test_hsdp_strategy checks it with bash -n"),
    "torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
    "--master-port 29500 examples/multinode_trainer.py --num-nodes 2 --devices 2 --device-mesh 2 2":
        NotHere("tests/lightning/test_hsdp_multinode.py runs it as two torchrun nodes on "
                "127.0.0.1"),
    "sbatch examples/slurm_llama.sbatch":
        NotHere("needs a SLURM cluster; test_examples.test_slurm_script_is_valid_bash checks it"),
    "python examples/memory_profile.py --strategy vescale_fsdp --devices 2": Runs(
        extra=("--n-layer", "2", "--n-embd", "64", "--steps", "2", "--out", "{tmp}"),
        check=lambda out, _: "rank 0: wrote" in out and "rank 1: wrote" in out),
    "python -m lightning_vescale.planner --preset llama3-70b --world-size 1024 --granularity row":
        Runs(check=lambda out, _: "2.778%" in out),
    "python -m lightning_vescale.planner --model examples.llama:LlamaModule --world-size 32":
        Runs(check=lambda out, _: "33 group(s)" in out),
    "python -m lightning_vescale.dryrun --preset llama3-70b --world-size 1024 "
    "--activation-checkpointing": Runs(  # two layers at 64 ranks: seconds, not minutes
        extra=("--config", '{"layers": 2}', "--seq-len", "128", "--world-size", "64"),
        check=lambda out, _: "ours/FSDP2" in out and "peak live bytes" in out),
}


def _readme_commands() -> list[str]:
    """Every command of the bash blocks of the README and the docs; of a ci: block, its parts
    after ``&&``."""
    out = []
    for b in (b for path in doc_files() for b in blocks(path)):
        if b.lang == "bash":
            out += [p.strip() for c in commands(b.text) for p in c.split("&&")] if b.ci \
                else commands(b.text)
    return out


# -- the tests -----------------------------------------------------------------------------------
def test_every_block_is_an_example_a_known_command_or_text():
    problems = []
    for path, b in ((path, b) for path in doc_files() for b in blocks(path)):
        where = f"{path.relative_to(ROOT)}:{b.line}"
        if b.lang in ("python", "yaml"):
            if b.example is None:
                problems.append(f"{where}: {b.lang} block without <!-- example: PATH -->")
            elif not (ROOT / b.example).is_file():
                problems.append(f"{where}: {b.example} does not exist")
            elif not is_excerpt(b.text, (ROOT / b.example).read_text()):
                problems.append(f"{where}: not a verbatim excerpt of {b.example}")
        elif b.lang == "bash":
            if not b.ci:
                problems += [f"{where}: command not in COMMANDS: {c!r}" for c in commands(b.text)
                             if c not in COMMANDS]
        elif b.lang != "text":
            problems.append(f"{where}: fence language {b.lang!r}: use python/yaml (an example), "
                            "bash (a command) or text")
    assert not problems, "\n".join(problems)
    stale = set(COMMANDS) - set(_readme_commands())
    assert not stale, f"COMMANDS entries no longer in the README or the docs: {sorted(stale)}"


def test_docs_pages_are_checked():
    """The check above reads the docs site's pages too (the guides hold most examples)."""
    pages = doc_files()
    assert ROOT / "docs" / "getting-started.md" in pages and len(pages) > 20
    assert any(b.example for b in blocks(ROOT / "docs" / "guides" / "trainer.md"))


def test_docs_ci_blocks_are_the_readmes():
    """A ci: block repeated in the docs is the README's (the one CI runs), verbatim."""
    readme = {b.text for b in blocks() if b.ci}
    for path in doc_files()[1:]:
        for b in blocks(path):
            if b.ci:
                assert b.text in readme, f"{path.relative_to(ROOT)}:{b.line} differs from README"


def test_excerpt_check_can_fail():
    assert is_excerpt("  a\n  b", "x\n    a\n    b\ny")
    assert not is_excerpt("a\nb", "a\nc\nb")


def test_one_exit_abort_is_started_once_more_and_no_other_failure(tmp_path):
    """The retry can fail: a failure without the abort, an abort before the output was
    complete and a second abort each fail; one abort after complete output is run again."""
    script = tmp_path / "s.py"
    script.write_text(
        "import pathlib, sys\n"
        "mark = pathlib.Path(sys.argv[1]); first = not mark.exists(); mark.touch()\n"
        "print('work done')\n"
        "if sys.argv[2] == 'always' or (sys.argv[2] == 'once' and first):\n"
        f"    sys.stderr.write({GLOO_EXIT_ABORT!r}); sys.exit(134)\n"
        "if sys.argv[2] == 'other': sys.exit(1)\n")
    done = lambda out: "work done" in out  # noqa: E731
    argv = lambda n, how: [sys.executable, str(script), str(tmp_path / n), how]  # noqa: E731
    assert "work done" in _run_once_more_after_exit_abort(argv("a", "once"), done)
    for name, how, is_done in (("b", "always", done), ("c", "other", done),
                               ("d", "once", lambda out: False)):
        with pytest.raises(AssertionError):
            _run_once_more_after_exit_abort(argv(name, how), is_done)


def test_ci_markers_give_the_documented_commands():
    awk = r"/<!-- ci:test-command -->/{f=1;next} /<!-- \/ci:test-command -->/{f=0} f && !/^```/"
    test_cmd = subprocess.run(["awk", awk, "README.md"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert test_cmd == ("python3 -m venv .venv && . .venv/bin/activate && pip install "
                        "torch==2.13.0 && pip install -e '.[dev,hf,clients,docs]' && "
                        "python -m pytest -q -m 'not slow' && python -m pytest -q -m slow")
    (main_block,) = [b for b in blocks() if b.ci and "pip install -e . &&" in b.text]
    assert main_block.text.endswith("&& python examples/train_gpt.py")
    assert "python examples/train_gpt.py" in COMMANDS  # ... and it runs below


def _params() -> list:
    out = []
    for command, how in COMMANDS.items():
        marks = [pytest.mark.slow]  # every command runs in a fresh process: the second CI step
        if isinstance(how, NotHere):
            marks.append(pytest.mark.skip(reason=how.why))
        out.append(pytest.param(command, how, marks=marks, id=command[:60]))
    return out


@pytest.mark.parametrize("command,how", _params())
def test_readme_command_runs(command, how, tmp_path):
    if isinstance(how, Custom):
        how.fn(tmp_path)
        return
    assert isinstance(how, Runs)
    extra = tuple(a.replace("{tmp}", str(tmp_path)) for a in how.extra)
    check = how.check

    def done(out: str) -> bool:  # the command's work finished: its output checks
        if check is None:
            return False  # nothing tells a finished run from one that aborted midway
        try:
            result = check(out, tmp_path)
        except AssertionError:
            return False
        return result is None or bool(result)

    out = _run_once_more_after_exit_abort(_argv(command, extra), done)
    if check is not None:
        result = check(out, tmp_path)
        assert result is None or result, out[-3000:]
