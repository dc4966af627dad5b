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
from p2ploco.metrics import MetricsLog, RoundRecord, TensorBoardLog


class RunDirectory:
    def __init__(self, path: Path, config: Config, fingerprint: str, resume: bool, out: Callable[[str], None]):
        """Open ``path`` for a run; a checkpoint already there is continued only with ``resume`` (else one line
        says what to do), so that no run overwrites another's."""
        self.checkpoints = path / "checkpoint"
        if checkpoint.exists(self.checkpoints) and not resume:
            raise CheckpointError(f"{self.checkpoints} already holds a checkpoint: pass --resume to continue it, "
                                  f"or another --log-dir")
        self.run_id, self.fingerprint, self.resume, self.out = config.run_id, fingerprint, resume, out
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config.model_dump(), indent=2))
        self.saver = checkpoint.BackgroundSaver(self.checkpoints, config.run_id, fingerprint)
        self.metrics = MetricsLog(path / "metrics.jsonl")
        self.board = TensorBoardLog(path / "tensorboard")
        if self.board.writer is not None:
            out(f"TensorBoard logs in {path / 'tensorboard'}")

    def saved(self) -> Checkpoint | None:
        """The checkpoint to resume from (None unless resuming): the newest intact one, a line said for each newer one
        that is not."""
        if not self.resume:
            return None
        return checkpoint.load(self.checkpoints, self.run_id, self.fingerprint, skipped=self.out)

    def write(self, record: RoundRecord) -> None:
        self.metrics.append(record)
        self.board.write(record)

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
