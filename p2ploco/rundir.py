"""Where a node keeps its run on disk: the config it ran with, a metrics record per round, TensorBoard logs and
checkpoints (written in the background)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from p2ploco import checkpoint
from p2ploco.checkpoint import Checkpoint
from p2ploco.config import Config
from p2ploco.errors import CheckpointError
from p2ploco.metrics import MetricsLog, RoundSummary, TensorBoardLog

RESUME = "always"  # --resume: continue the checkpoint in the run directory; there must be one ("auto": if any)


class RunDirectory:
    def __init__(self, path: Path, config: Config, fingerprint: str, resume: str | None, out: Callable[[str], None]):
        """Open ``path`` for a run. A checkpoint already there is continued only with ``resume`` (``RESUME``, or
        "auto": continue one if there is one, else start afresh, as a supervisor's restarts do), else one line says
        what to do, so that no run overwrites another's. The checkpoint is read and verified before anything is
        written, so that a refused start leaves the folder as it was."""
        self.checkpoints = path / "checkpoint"
        found = checkpoint.exists(self.checkpoints)
        if found and resume is None:
            raise CheckpointError(f"{self.checkpoints} already holds a checkpoint: pass --resume to continue it "
                                  f"(--resume auto: continue one if there is one, else start afresh), or another "
                                  f"--log-dir")
        self.run_id, self.fingerprint = config.run_id, fingerprint
        # the newest intact checkpoint there, a line said for each newer one that is not
        self.resumed = (checkpoint.load(self.checkpoints, config.run_id, fingerprint, skipped=out)
                        if found or resume == RESUME else None)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config.model_dump(), indent=2))
        self.saver = checkpoint.BackgroundSaver(self.checkpoints, config.run_id, fingerprint)
        self.metrics = MetricsLog(path / "metrics.jsonl")
        self.board = TensorBoardLog(path / "tensorboard")
        if self.board.writer is not None:
            out(f"TensorBoard logs in {path / 'tensorboard'}")

    def write(self, summary: RoundSummary) -> None:
        self.metrics.append(summary)
        self.board.write(summary)

    def save(self, state: Checkpoint) -> None:
        """Start writing ``state`` in the background (after the write under way)."""
        self.saver.save(state)

    def finish(self, state: Checkpoint) -> None:
        """The exit checkpoint, written before this returns; the TensorBoard log is closed."""
        self.board.close()
        self.saver.save(state)
        self.saver.wait()

    def close(self) -> None:
        """Finish a checkpoint being written, also when the node stops at once."""
        self.saver.close()
