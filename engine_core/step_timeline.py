"""The engine's own step timeline, for the host-overhead breakdown (`--breakdown`).

Off by default. When on, each step appends one row of wall-clock phase durations; a handful
of perf_counter reads and one list append per step, so it does not perturb what it measures.
"""

from __future__ import annotations

from protocol.messages import ModelRunnerOutput, SchedulerOutput

# Row layout (microseconds except where noted). worker_* come from rank 0's own clock.
COLUMNS = [
    "start_s",  # perf_counter seconds at step start
    "schedule_us",
    "encode_us",
    "broadcast_us",  # PUB send
    "wait_us",  # send -> rank 0's tokens back (includes everything the worker did)
    "update_us",
    "emit_us",  # RequestOutputs to the frontend
    "worker_prep_us",  # apply diff + build (and on CUDA stage) inputs
    "worker_forward_us",  # launch -> the step's tokens ready (the device's time for it)
    "worker_sample_us",  # the host's work on the tokens (into the batch, the output)
    "num_tokens",
    "frame_bytes",
    "end_s",  # perf_counter seconds when the step's outputs were sent; with async scheduling
    # steps overlap, so step wall time is the gap between consecutive end_s
    # rank 0's host time between the launch before this step and this step's launch (its
    # diff applied, inputs built, the step before's tokens handed on), not counting time
    # blocked on the socket or the device: the part while the step before still ran on the
    # device (worker overlap hides it) and the part while the device waited for the host
    "worker_hidden_us",
    "worker_exposed_us",
]
# the worker's own timings (ModelRunnerOutput.timings_us), in their order
WORKER_COLUMNS = ["worker_prep_us", "worker_forward_us", "worker_sample_us",
                  "worker_hidden_us", "worker_exposed_us"]


class StepTimeline:
    def __init__(self) -> None:
        self.enabled = False
        self.rows: list[list[float]] = []

    def start(self) -> None:
        self.enabled = True
        self.rows = []

    def stop(self) -> list[list[float]]:
        self.enabled = False
        rows, self.rows = self.rows, []
        return rows

    def record(
        self,
        t0: float,
        t1: float,
        t2: float,
        t3: float,
        t4: float,
        t5: float,
        t6: float,
        so: SchedulerOutput,
        out: ModelRunnerOutput,
        frame_bytes: int,
    ) -> None:
        w = list(out.timings_us) + [0.0] * (len(WORKER_COLUMNS) - len(out.timings_us))
        self.rows.append(
            [
                t0,
                (t1 - t0) * 1e6,
                (t2 - t1) * 1e6,
                (t3 - t2) * 1e6,
                (t4 - t3) * 1e6,
                (t5 - t4) * 1e6,
                (t6 - t5) * 1e6,
                w[0],
                w[1],
                w[2],
                float(so.total_num_scheduled_tokens),
                float(frame_bytes),
                t6,
                w[3],
                w[4],
            ]
        )
