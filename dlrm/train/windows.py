"""The training loop's logging windows (`WindowLogging`, mixed into `dlrm.train.trainer.Trainer`): queued at a logging
step without a host sync, read one step late (the intended sync, once a window), logged to the log and TensorBoard;
with several ranks the signal that stops the run is agreed through those reads; and the NaN/Inf checks that stop a
diverged run. The trainer owns the state they read (meter, env, run, pos, writer, device, checkpointer, stats)."""

from __future__ import annotations

from typing import Optional

import torch
from tqdm import tqdm

from dlrm.errors import NonFiniteLoss
from dlrm.train.meter import DeviceRead, WindowCut
from dlrm.train.optim import trained_lrs
from dlrm.train.reporting import log_train
from dlrm.train.signals import GracefulStop
from dlrm.train.step import nonfinite_weight


class WindowLogging:
    """The logging windows, the agreed stop signal and the NaN/Inf checks of a `Trainer`."""

    # The signal that stops the run (0: none). With several ranks, the largest number any rank got: a rank that got
    # none stops with the others' exit code (128 + signal), not 128.
    _stop_signal = 0

    _pending: Optional[tuple[WindowCut, DeviceRead]] = None  # a logging window queued, not read yet
    _window_stop: Optional[GracefulStop] = None  # the loop's signal handler, as the window was queued

    def _stop_requested(self, stop: GracefulStop) -> bool:
        """A signal arrived; with several ranks, once they all know (they agree through the logging windows' reads):
        also one that reached one rank only, at most train.log_every steps after the step in flight (no per-step sync)."""
        if not self.env.distributed:
            self._stop_signal = stop.signum or 0
        return self._stop_signal > 0

    def _signal_after_loop(self, stop: GracefulStop) -> bool:
        """A signal after the loop's last look at it (as its last window was read, say), agreed by the ranks through
        one all-reduce: unseen, it was lost."""
        agreed = self.env.all_reduce_max(torch.tensor([int(stop.signum or 0), int(stop.signum is None)],
                                                      device=self.device)).tolist()
        self._stop_signal = int(agreed[0])
        if self._stop_signal:
            stop.say_deferred(alone=bool(agreed[1]))
        return self._stop_signal > 0

    def _queue_window(self, stop: GracefulStop) -> None:
        """A logging step: the window's loss sum, its first NaN/Inf step, the learning rates this step trained with
        (not the next step's, which the schedulers have set by now) and, with several ranks, whether any got a signal,
        reduced on the device and copied to the host behind this step, without a sync.
        `_read_window` reads them after the next step is queued, so the device never drains at a logging step."""
        meter, env = self.meter, self.env
        values = [env.all_reduce_sum(meter.losses.total()), env.all_reduce_max(meter.losses.first_nonfinite_step())]
        values += trained_lrs(self.run.optimizers[:2], self.run.schedulers)  # the rates this step trained with
        if env.distributed:  # the largest signal, and (its MAX of 1 - got) whether some rank got none: one reduce
            agreed = env.all_reduce_max(filled_on_device([int(stop.signum or 0), int(stop.signum is None)], self.device))
            values += [agreed[0], agreed[1]]
        self._pending = (meter.cut_window(self.pos.step), DeviceRead(*values))
        self._window_stop = stop  # (whose deferred signal line the read says or drops: `GracefulStop.say_deferred`)

    def _read_window(self, bar: tqdm) -> None:
        if self._pending is not None:
            self._log_window(bar)

    def _log_window(self, bar: tqdm) -> None:
        """The queued logging window: waits for its copies (intended host sync, once per logging interval; the device
        has the next step queued), stops on a NaN/Inf loss, logs the mean loss, rate and data wait."""
        (cut, read), self._pending = self._pending, None
        total, bad, lr_dense, lr_sparse, *stopping = read.get()
        if stopping:  # the ranks agree: every one reads the same reduced signal number after the same step
            self._stop_signal = int(stopping[0])
            if self._stop_signal and self._window_stop is not None:
                self._window_stop.say_deferred(alone=bool(stopping[1]))
        self._raise_if_nonfinite(int(bad))
        mean_loss = total / self.env.world_size / cut.steps  # the ranks' shares summed: the global mean
        rate, wait = self.meter.close_window(cut, mean_loss)
        log_train(self.writer, cut.step, mean_loss, (float(lr_dense), float(lr_sparse)), rate, wait)
        # refresh=False: shown at the bar's next timed redraw (a forced one per window flooded a log file); this
        # window's rate only (the last closed window's showed beside a window that has none, as if it were its own)
        bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False,
                        **({"samples_s": f"{rate:,.0f}"} if rate is not None else {}))

    def _check_finite(self) -> None:
        """Stop with NonFiniteLoss naming the first NaN/Inf loss since the last logging step, or a NaN/Inf weight (an
        update that overflowed: its loss was finite); host syncs at checkpoint steps, diverged evaluations, the end."""
        self._raise_if_nonfinite(int(self.env.all_reduce_max(self.meter.losses.first_nonfinite_step()).item()))
        weight = nonfinite_weight(self.run.model, self.env)  # the ranks agree on both
        self._raise_if_nonfinite(self.pos.step if weight else -1, f"weight {weight}")

    def _raise_if_nonfinite(self, bad: int, what: str = "loss") -> None:
        if bad >= 0:
            raise NonFiniteLoss(f"{what} became NaN or Inf at step {bad}; stopped; {self.checkpointer.last_good(self.stats.best)}")


def filled_on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device`, written by fill kernels queued behind the step: no host sync.
    ``torch.tensor(values, device="cuda")`` copies from pageable host memory, which waits for every queued kernel (the
    whole step a logging window's reads are meant to run behind, once a window under torchrun)."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        # fill_ with the Python number: a fill kernel taking the value as its argument. Not ``out[i] = value``: on CUDA
        # torch's setitem makes the number a host tensor and copies it into the element (copy_'s blocking H2D copy,
        # which waits for the queued step: the very sync this function avoids; a slice's assignment fills instead)
        out[i].fill_(value)
    return out

