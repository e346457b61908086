"""Secrets: what must never reach the files and terminal output hpc-ddp writes (scripts, spec views,
events.jsonl, rank logs, status), and how to mask it.

Two sources, both matched by one compiled regex per environment, so masking a log line costs one scan:
  - values of environment variables whose NAME looks secret (GITHUB_TOKEN, WANDB_API_KEY,
    AWS_SECRET_ACCESS_KEY, ...), wherever they appear;
  - text whose SHAPE is a secret (ghp_..., hf_..., AKIA..., JWTs, private key blocks, `password=...`),
    whatever its origin (a token passed as an argument, printed by the user's program).

Pure except `current()`, the edge that reads os.environ. Masked text reads `***`; names stay visible.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["MASK", "Leak", "Scrubber", "current", "is_secret_name", "scrub", "secret_env", "secret_values"]

MASK = "***"

# Name parts (split on _ - . and camelCase) that make a variable secret on their own...
_SECRET_PARTS = frozenset({
    "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE", "APIKEY",
    "CREDENTIAL", "CREDENTIALS", "AUTH", "SESSION", "COOKIE", "COOKIES", "SIGNATURE",
})
# ...KEY only after one of these (a bare KEY is too often not a secret: LESSKEY, a sort key)...
_KEY_QUALIFIERS = frozenset({"API", "ACCESS", "PRIVATE", "SECRET", "SIGNING", "ENCRYPTION", "CLIENT"})
# ...and run-together names (GHTOKEN, DBPASSWORD) by their ending.
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY")
# Scheduler and desktop-session variables: their values are job or session metadata that appears in
# every log (node names, bus addresses); masking them would mangle the logs and protect nothing.
_NOT_SECRET_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "XDG_")
_NOT_SECRET_NAMES = frozenset({"DBUS_SESSION_BUS_ADDRESS", "SESSION_MANAGER", "DESKTOP_SESSION"})
_PLAIN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "enabled", "disabled"})
_MIN_LEN = 6

_SHAPES = (
    ("a GitHub token", r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
    ("a GitLab token", r"\bglpat-[A-Za-z0-9_-]{20,}"),
    ("a Hugging Face token", r"\bhf_[A-Za-z0-9]{30,}"),
    # sk-... keys mix case and digits; the lookaheads keep paths like runs/sk-baseline-... out.
    ("an API key (sk-...)", r"\bsk-(?=[A-Za-z0-9_-]*[0-9])(?=[A-Za-z0-9_-]*[A-Z])[A-Za-z0-9_-]{20,}"),
    ("a Stripe key", r"\b[rs]k_live_[A-Za-z0-9]{16,}"),
    ("an AWS access key id", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("a Google API key", r"\bAIza[0-9A-Za-z_-]{35}"),
    ("a Slack token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("a JSON web token", r"\beyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),
    # An unterminated block is masked to the end of the text (`lines()` handles it line by line).
    ("a private key", r"(?s:-----BEGIN[A-Z ]*PRIVATE KEY-----(?:.*?-----END[A-Z ]*PRIVATE KEY-----|.*))"),
)
_WORDS = r"password|passwd|passphrase|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credentials?"
# `password=x`, `"token": "x"`, `--hf-token x`, `Bearer x`: only the value is masked, the key stays.
# The option name is bounded and must start a dash run, so a long run of dashes costs linear time.
_KEYED = (rf"(?P<key>(?i:(?:{_WORDS})[\"']?[ \t]*[:=][ \t]*[\"']?"
          rf"|(?<![\w-])--(?:[A-Za-z0-9][A-Za-z0-9-]{{0,62}}?)?(?:{_WORDS})(?:=|[ \t]+)[\"']?))"
          r"(?P<value>[^\s\"'`,;&|(){}\[\]]+)"
          r"|(?P<bearer>(?i:\bbearer[ \t]+))(?P<bvalue>[A-Za-z0-9._~+/-]{16,}=*)")
_BEGIN = re.compile(r"-----BEGIN[A-Z ]*PRIVATE KEY-----")
_END = re.compile(r"-----END[A-Z ]*PRIVATE KEY-----")


def _name_parts(name: str) -> list[str]:
    return [p.upper() for p in re.split(r"[_\-.]+|(?<=[a-z0-9])(?=[A-Z])", name) if p]


@functools.lru_cache(maxsize=4096)  # the same few hundred names are asked about on every record
def is_secret_name(name: str) -> bool:
    """Does this variable NAME look like it holds a secret?"""
    upper = name.upper()
    if upper.startswith(_NOT_SECRET_PREFIXES) or upper in _NOT_SECRET_NAMES:
        return False
    parts = _name_parts(name)
    if any(p in _SECRET_PARTS or p.endswith(_SECRET_ENDINGS) for p in parts):
        return True
    return any(a in _KEY_QUALIFIERS and b == "KEY" for a, b in itertools.pairwise(parts))


def _maskable(value: str) -> bool:
    """Worth masking everywhere: long enough, not a plain word, number or path. A path says where a secret
    is kept (PASSWORD_STORE_DIR, GOOGLE_APPLICATION_CREDENTIALS), not the secret; masking it, or a
    number, would mangle the tracebacks and step counts people read the logs for."""
    if len(value) < _MIN_LEN or value.lower() in _PLAIN_WORDS:
        return False
    if re.fullmatch(r"[+-]?[0-9][0-9.,_:eE+-]*", value):
        return False
    return not value.startswith(("/", "~/", "./", "../"))


def secret_env(environ: Mapping[str, str]) -> dict[str, str]:
    """{name: value} of the variables whose name looks secret and whose value is worth masking."""
    out = {}
    for name, value in environ.items():
        value = value.strip()
        if is_secret_name(name) and _maskable(value):
            out[name] = value
    return out


def secret_values(environ: Mapping[str, str]) -> frozenset[str]:
    return frozenset(secret_env(environ).values())


def _is_reference(value: str) -> bool:
    """A keyed value that is not a secret: `$VAR`, a placeholder, already masked, a number or a word."""
    return (value.startswith(("$", "%", "<", "{{", MASK)) or value.lower() in _PLAIN_WORDS
            or bool(re.fullmatch(r"[+-]?[0-9][0-9.]*", value)))


@dataclasses.dataclass(frozen=True)
class Leak:
    """What a text would disclose: `what` is safe to print (a variable name or a kind, never the value)."""
    what: str
    name: str | None = None     # the environment variable it came from, when it did


class Scrubber:
    """Masks secrets in text. Build once (per environment) and call per line or per text."""

    def __init__(self, named: Mapping[str, str] | Iterable[str] = ()):
        """`named`: {name: value} of secret variables, or just values (then no names to report)."""
        pairs = named.items() if isinstance(named, Mapping) else ((None, v) for v in named)
        self._names: dict[str, str | None] = {}
        for name, value in pairs:
            if value and (value not in self._names or self._names[value] is None):
                self._names[value] = name
        # Longest first: where one secret contains another, the whole of the longer one is masked.
        literals = "|".join(re.escape(v) for v in sorted(self._names, key=len, reverse=True))
        shapes = "|".join(pattern for _, pattern in _SHAPES)
        head = f"(?P<env>{literals})|" if literals else ""
        self._regex = re.compile(f"{head}(?:{shapes})|{_KEYED}")

    def __call__(self, text: str) -> str:
        return self._regex.sub(self._replace, text) if text else text

    def _replace(self, m: re.Match) -> str:
        if m.group("bvalue") is not None:
            return m.group("bearer") + MASK
        value = m.group("value")
        if value is None:
            return MASK  # an environment value or a shape
        return m.group(0) if _is_reference(value) else m.group("key") + MASK

    def lines(self, lines: Iterable[str]) -> Iterator[str]:
        """Mask a stream of lines (a rank's output), keeping line endings; a private key block spans lines,
        so every line between BEGIN and END is masked whole."""
        inside = False
        for line in lines:
            body = line.rstrip("\r\n")
            if inside:
                inside = not _END.search(body)
                yield MASK + line[len(body):]
                continue
            inside = bool(_BEGIN.search(body)) and not _END.search(body)
            yield self(body) + line[len(body):]

    def deep(self, value: Any) -> Any:
        """Mask every string inside a JSON-like value (dict values, lists); other objects become their str."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.deep(v) for v in value]
        if value is None or isinstance(value, (bool, int, float)):
            return value
        return self(str(value))

    def leaks(self, text: str) -> list[Leak]:
        """What `text` would disclose, for refusing it with a message that names no value."""
        found = [Leak(f"the value of ${name}" if name else "the value of a secret variable", name)
                 for value, name in self._names.items() if value in text]
        found += [Leak(what) for what, pattern in _SHAPES if re.search(pattern, text)]
        if not found and self(text) != text:
            found.append(Leak("a secret in a `key=value` or `--option value` form"))
        return found


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with every one of `values`, and everything shaped like a secret, replaced by `***`."""
    return Scrubber(values)(text)


def current(environ: Mapping[str, str] | None = None) -> Scrubber:
    """The scrubber for this process's environment (the edge: reads os.environ). Cheap to call per record:
    it is rebuilt only when the secret variables change."""
    return _cached(tuple(sorted(secret_env(os.environ if environ is None else environ).items())))


@functools.lru_cache(maxsize=8)
def _cached(items: tuple[tuple[str, str], ...]) -> Scrubber:
    return Scrubber(dict(items))
