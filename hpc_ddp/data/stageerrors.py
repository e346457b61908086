"""What staging raises (staging.py, archives.py, stagelock.py); staging.py re-exports them. StageRefused, the
base of ScratchUnusable, is spec.datasource's: the spec refuses a source that cannot be staged before any job."""

from __future__ import annotations

from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.spec.datasource import StageRefused


class StagingError(HpcDdpError):
    """Staging failed (disk full, copy mismatch, ...)."""


class ScratchUnusable(StageRefused):
    """The destination cannot take the dataset; a job may fall back to reading the shared copy."""


class TargetOccupied(ScratchUnusable):
    """Something hpc-ddp did not make sits where the staged copy (or its marker) would go."""


class BadArchive(UserError):
    """The archive cannot be read: truncated, corrupt, or not the format its name says."""


class HostileArchive(UserError):
    """An archive member would land outside the target directory."""
