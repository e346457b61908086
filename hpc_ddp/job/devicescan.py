"""How a script picks its GPU, read from its text, and whether that way works under the job's GPU binding.

`scan(source)` finds the common ways (line by line, no import, no execution):
  local_rank   set_device(local_rank), f"cuda:{local_rank}", device_ids=[local_rank], .to(LOCAL_RANK),
               torch.distributed.launch's --local_rank, SLURM_LOCALID
  framework    Lightning, Fabric, accelerate, the Hugging Face Trainer: they pick cuda:LOCAL_RANK themselves
  fixed        cuda:0, set_device(0), .cuda(1), device_ids=[0]: one index for every rank
  rank         the global rank as a device index (cuda:RANK): past the first node it names no GPU
  plain        torch.device("cuda"), .cuda(), .to("cuda"): the current device, which hpc-ddp sets
  hpc_ddp      hpc_ddp.start()'s run.device: always the rank's own

`judge(picks, exposure)` says, for one binding (`Exposure`: what each rank sees), which of them cannot put
each rank of a node on a distinct, existing GPU: an error where it certainly cannot (`cuda:LOCAL_RANK` where
each rank sees one GPU), a warning where the scan may be wrong (a fixed index may sit in dead code; the
start-up check in exitsite/hpc_ddp_rankguard.py stops a real clash). `submit` and `doctor` judge the spec's
binding; the runner judges the binding it really got (a site's job_submit may bind per task). Pure.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Iterable, Sequence

from hpc_ddp.job.gpubind import effective_mode

__all__ = ["Pick", "Exposure", "Problem", "scan", "judge", "exposure_of", "slurm_binds_per_task", "code_part",
           "code_only", "python_lines",
           "source_of", "source_bytes", "runtime_exposure", "MAX_SOURCE"]

MAX_SOURCE = 4 * 1024 * 1024  # bytes: a larger script is not scanned
# characters of a line that are scanned: no device pick is longer, and the local_rank pattern rescans a line
# from every call in it (a generated line of 8,000 `.to(` took minutes)
MAX_LINE = 1000

_LOCAL = r"(?:local[_-]?rank|LOCAL_RANK|SLURM_LOCALID|local_process_index|localid)"
_DEVICE_CALL = (r"(?:set_device|\.cuda|\.to|torch\.device|device_ids\s*=|output_device\s*=|device\s*=|"
                r"map_location\s*=)")
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("hpc_ddp", re.compile(r"\bhpc_ddp\.start\s*\(|from\s+hpc_ddp\s+import\s+.*\bstart\b")),
    ("framework", re.compile(r"^\s*(?:import|from)\s+(?:lightning|pytorch_lightning|accelerate)\b"
                             r"|^\s*from\s+transformers\s+import\s+.*\bTrainer\b")),
    ("local_rank", re.compile(rf"{_DEVICE_CALL}\s*\(?[^#\n]*{_LOCAL}|cuda:\{{[^}}]*{_LOCAL}"
                              rf"|[\"']cuda:(?:\{{\}}|%d)[\"'][^#\n]*{_LOCAL}"
                              r"|add_argument\(\s*[\"']--local[_-]rank[\"']", re.IGNORECASE)),
    ("fixed", re.compile(r"[\"']cuda:\d+[\"']|set_device\(\s*\d+\s*\)|\.cuda\(\s*\d+\s*\)"
                         r"|device_ids\s*=\s*\[\s*\d+\s*\]|torch\.device\(\s*[\"']cuda[\"']\s*,\s*\d+\s*\)")),
    ("rank", re.compile(r"(?:set_device|\.cuda|\.to)\(\s*(?:args\.)?rank\s*\)"
                        r"|device_ids\s*=\s*\[\s*(?:args\.)?rank\s*\]|cuda:\{(?:args\.)?rank\}"
                        r"|torch\.device\(\s*[\"']cuda[\"']\s*,\s*(?:args\.)?rank\s*\)")),
    ("plain", re.compile(r"torch\.device\(\s*[\"']cuda[\"']\s*\)|\.cuda\(\s*\)|\.to\(\s*[\"']cuda[\"']\s*\)"
                         r"|device\s*=\s*[\"']cuda[\"']")),
)
_SPAWNS = re.compile(r"\b(?:mp|multiprocessing)\.spawn\s*\(|start_processes\s*\(")


@dataclasses.dataclass(frozen=True)
class Pick:
    kind: str
    line: int   # 1-based
    text: str   # the line, stripped and shortened
    index: int | None = None  # "fixed": the GPU index it names


@dataclasses.dataclass(frozen=True)
class Exposure:
    """What every rank of a node sees: `visible` GPUs, its own being `per_rank` of them from index
    `local_rank * per_rank` ("node") or from 0 ("rank", "slurm": Slurm bound them)."""

    how: str             # "node" | "rank" | "slurm"
    visible: int         # GPUs each rank sees
    per_rank: int        # GPUs that are each rank's own
    local_world_size: int
    nodes: int = 1
    bound_by: str = ""   # what made it so, for the message: "--gpu-bind rank", "Slurm (--gpus-per-task 1)"


@dataclasses.dataclass(frozen=True)
class Problem:
    level: str  # "error" | "warning"
    message: str
    hint: str


# What is not code: a comment, or a string literal of any kind (its prefix letters stay, harmlessly).
_NOT_CODE = re.compile(r"#[^\n]*"
                       r"|'''(?:[^'\\]|\\.|'(?!''))*(?:'''|\Z)"
                       r'|"""(?:[^"\\]|\\.|"(?!""))*(?:"""|\Z)'
                       r"|'(?:[^'\\\n]|\\.)*(?:'|$)"
                       r'|"(?:[^"\\\n]|\\.)*(?:"|$)', re.M | re.S)
# The ends of a line as Python counts them: not a form feed, U+2028 or the other breaks str.splitlines takes
_LINE_END = re.compile(r"\r\n|\r|\n")


def python_lines(source: str) -> list[str]:
    """`source`'s lines as Python numbers them (str.splitlines also breaks at a form feed, U+2028, ...)."""
    return _LINE_END.split(source)


def code_only(source: str) -> str:
    """`source` with its comments and string literals blanked (each literal becomes '' or "", followed by
    the newlines it held, so every line keeps its number), its lines joined by newlines (CR and CRLF ends
    too, as Python counts them) and a byte-order mark dropped. Linear, and needs no valid syntax: an
    unterminated string runs to the end of its line, or of the text for a triple quote."""
    text = "\n".join(python_lines(source.lstrip("\ufeff")))
    return _NOT_CODE.sub(lambda m: "" if m.group().startswith("#") else
                         m.group()[0] * 2 + "\n" * m.group().count("\n"), text)


def _not_code(text: str) -> tuple[list[int], list[int]]:
    """The spans of `text` that are no code (sorted starts, their ends): a comment whole, a string literal
    but its opening quote (a pick such as "cuda:0" begins with it)."""
    starts, ends = [], []
    for m in _NOT_CODE.finditer(text):
        starts.append(m.start() + (0 if m.group().startswith("#") else 1))
        ends.append(m.end())
    return starts, ends


def scan(source: str) -> tuple[Pick, ...]:
    """The device picks in `source`, one per line (the first kind that matches, in the order above). A
    match counts where it begins in code: set_device(local_rank) in a docstring, a string or a comment is
    no pick. Lines are numbered as Python numbers them."""
    picks = []
    lines = python_lines(source.lstrip("\ufeff"))
    text = "\n".join(lines)
    starts, ends = _not_code(text)
    spawns = any(_in_code(m.start(), starts, ends) for m in _SPAWNS.finditer(text))
    offset = 0
    for number, raw in enumerate(lines, 1):
        base, offset = offset, offset + len(raw) + 1
        line = raw[:MAX_LINE]
        if not line.strip():
            continue
        for kind, pattern in _PATTERNS:
            found = next((m for m in pattern.finditer(line) if _in_code(base + m.start(), starts, ends,
                                                                         m.group().startswith("cuda:"))), None)
            if found:
                if kind in ("local_rank", "rank") and "cpu" in line and "cuda" not in line:
                    continue  # torch.device("cpu:{}".format(local_rank)): no GPU picked
                if kind == "rank" and spawns:  # mp.spawn's first argument is the rank on this node
                    kind = "local_rank"
                index = int(re.findall(r"\d+", found.group())[-1]) if kind == "fixed" else None
                picks.append(Pick(kind, number, _short(raw.strip()), index))
                break
    return tuple(picks)


def _in_code(at: int, starts: list[int], ends: list[int], opens: bool = False) -> bool:
    """`at` is in code; with `opens`, also where a string's text begins there (f"cuda:{local_rank}")."""
    i = bisect.bisect_right(starts, at) - 1
    return i < 0 or at >= ends[i] or (opens and at == starts[i])


def code_part(line: str) -> str:
    """The line without a trailing comment (a '#' outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def slurm_binds_per_task(args: Iterable[str]) -> str | None:
    """The sbatch/srun option that makes Slurm bind GPUs to each task (`--gpus-per-task=1`,
    `--gpu-bind=single:1`), as the user typed it; None where none does."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in ("--gpus-per-task", "--gpu-bind") and not arg.endswith(("=none", "=verbose,none")):
            return arg
    return None


def exposure_of(spec, extra_args: Sequence[str] = ()) -> Exposure | None:
    """What the ranks of `spec` will see (None: a CPU job). Slurm options in sbatch_args/srun_args that
    bind GPUs per task win over --gpu-bind, as they do on the nodes."""
    if not spec.gpus:
        return None
    per_task = max(spec.gpus // spec.tasks_per_node, 1)
    common = dict(per_rank=per_task, local_world_size=spec.tasks_per_node, nodes=spec.nodes)
    bound = slurm_binds_per_task([*spec.sbatch_args, *spec.srun_args, *extra_args])
    if bound is not None:
        return Exposure("slurm", per_task, bound_by=f"Slurm ({bound})", **common)
    how = effective_mode(spec.gpu_bind, per_task)
    shown = f"--gpu-bind {spec.gpu_bind}" + (" (the default)" if spec.gpu_bind == "auto" else "")
    return Exposure(how, spec.gpus if how == "node" else per_task, bound_by=shown, **common)


_ANY_BINDING = "torch.device('cuda') (each rank's own GPU under any binding) or hpc_ddp.start()'s run.device"


def judge(picks: Sequence[Pick], exposure: Exposure | None, where: str = "the script") -> list[Problem]:
    """The picks that cannot give each rank of a node its own existing GPU under `exposure`."""
    if exposure is None or not picks:
        return []
    problems = []
    for kind in ("local_rank", "framework", "fixed", "rank"):
        first = next((p for p in picks if p.kind == kind), None)
        if first is not None:
            problem = _judge_one(first, exposure, f"{where}:{first.line}")
            if problem is not None:
                problems.append(problem)
    return problems


def _judge_one(pick: Pick, e: Exposure, at: str) -> Problem | None:
    local = e.local_world_size
    if pick.kind in ("local_rank", "framework"):
        how = "picks its GPU by local rank" if pick.kind == "local_rank" else \
            "uses a framework that picks cuda:LOCAL_RANK"
        if e.how == "node":
            if e.per_rank > 1 and local > 1:
                return Problem("warning", f"{at} {how} ({pick.text}), but each rank has {e.per_rank} GPUs: local "
                               "rank 1's cuda:1 is local rank 0's second GPU",
                               f"give each rank one GPU (--gpus {local}), or use --gpu-bind rank and "
                               f"cuda:0..{e.per_rank - 1}")
            return None
        if local > e.visible:
            fix = ("ask for GPUs per node without per-task binding (--gpus N, no --gpus-per-task or --gpu-bind in "
                   "--sbatch-arg/--srun-arg)" if e.how == "slurm" else "drop --gpu-bind rank (the default, auto, keeps "
                   "the node's GPUs visible, as torchrun does)")
            return Problem("error", f"{at} {how} ({pick.text}), but {e.bound_by} lets each rank see only "
                           f"{_own(e.visible)}: local rank {e.visible} would find no cuda:{e.visible}",
                           f"{fix}; or pick {_ANY_BINDING}")
        return None
    if pick.kind == "fixed":
        index = pick.index or 0
        if e.how == "node" and local > 1:
            return Problem("warning", f"{at} uses a fixed GPU ({pick.text}): every rank of a node sees the node's "
                           f"{_gpus(e.visible)}, so all {local} would share one (the job stops at start-up if "
                           "they do)", f"use --gpu-bind rank (each rank then sees only its own GPU, as cuda:0), or "
                           f"pick {_ANY_BINDING}")
        if e.how != "node" and index >= e.visible:
            return Problem("error", f"{at} uses cuda:{index} ({pick.text}), but {e.bound_by} lets each rank see "
                           f"only {_own(e.visible)}", f"pick {_ANY_BINDING}")
        return None
    if pick.kind == "rank" and e.nodes == 1:  # on one node RANK is LOCAL_RANK
        return _judge_one(dataclasses.replace(pick, kind="local_rank"), e, at)
    if pick.kind == "rank":
        return Problem("warning", f"{at} picks its GPU by the global rank ({pick.text}): on every node but the first, "
                       "RANK is past the node's GPUs", f"use LOCAL_RANK instead of RANK, or pick {_ANY_BINDING}")
    return None


def _own(n: int) -> str:
    return "its own GPU, as cuda:0" if n == 1 else f"its own {n} GPUs, as cuda:0..{n - 1}"


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def runtime_exposure(how: str, visible: int, per_rank: int, local_world_size: int, nodes: int,
                     cuda_visible: str | None) -> Exposure:
    """The binding a rank really got (gpubind.Binding.how), for `judge` at start-up."""
    bound_by = {"node": "--gpu-bind node", "rank": "--gpu-bind rank",
                "slurm": f"Slurm (this task's CUDA_VISIBLE_DEVICES={cuda_visible}: --gpus-per-task, --gpu-bind or "
                         "the site's defaults bound GPUs per task)"}.get(how, how)
    return Exposure(how, visible, max(per_rank, 1), local_world_size, nodes, bound_by)


# ---- the one edge: the text to scan ----

def source_of(kind: str, value: str, workdir: str) -> tuple[str, str] | None:
    """(path, text) of a script target, or of a module target's file found under `workdir` without
    importing anything (`pkg.train` -> pkg/train.py or pkg/train/__main__.py); None where there is none
    to read (the built-in trainer, a module installed elsewhere, an unreadable file, more than MAX_SOURCE)."""
    found = source_bytes(kind, value, workdir)
    return None if found is None else (found[0], found[1].decode("utf-8", errors="replace"))


def source_bytes(kind: str, value: str, workdir: str, limit: int = MAX_SOURCE) -> tuple[str, bytes] | None:
    """source_of's file as bytes, up to `limit` (the compile check reads bigger scripts than the scans)."""
    import os

    if kind == "script":
        candidates = [value if os.path.isabs(value) else os.path.join(workdir, value)]
    elif kind == "module":
        base = os.path.join(workdir, *value.split("."))
        candidates = [base + ".py", os.path.join(base, "__main__.py")]
    else:
        return None
    from hpc_ddp.common.durable import read_regular

    for path in candidates:
        try:  # a regular file only (no FIFO or device is opened); a link is read where it points
            data = read_regular(os.path.realpath(path), limit=limit)
        except (OSError, ValueError):
            continue
        return path, data
    return None
