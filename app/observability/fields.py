"""The numbers each rank measures per monitor window, named once: the monitor's row and its report
(app/observability/monitor.py), the run summary and the TensorBoard layout (app/observability/tensorboard_layout.py)
all read this table, so none of them can lose a field by position.

Every rank measures every field on every device (a CUDA field is 0 on a CPU), so the gathered table keeps one shape;
only the fields that ``logged_fields`` gives for the run are logged, charted and summarised.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowField:
    """A column of the window's table: one value per rank, logged as ``monitor/NAME/rank<R>`` and min, median, max."""

    name: str
    chart: str | None  # the title of its charts in TensorBoard's CUSTOM SCALARS tab; None: not charted
    cuda_only: bool = False  # measured on GPUs only: elsewhere a series of zeros, so not logged
    pipeline_only: bool = False  # measured under a pipeline only, likewise
    expert_parallel_only: bool = False  # measured with experts split over ranks only, likewise
    summary: str | None = None  # its line in the run summary, the largest rank's peak over the run (memory, GiB)

    def tag(self, statistic: str) -> str:
        """Its TensorBoard tag for ``statistic``: rank0, rank1, ..., min, median or max."""
        return f"monitor/{self.name}/{statistic}"

    def measured_on(self, cuda: bool, pipeline: bool, expert_parallel: bool = False) -> bool:
        return ((cuda or not self.cuda_only) and (pipeline or not self.pipeline_only)
                and (expert_parallel or not self.expert_parallel_only))


DATA_WAIT = WindowField("data_wait_s", "data wait (s)")
COMPUTE = WindowField("compute_s", "compute (s)")
SYNC_WAIT = WindowField("sync_wait_s", "sync wait (s)")
STEP = WindowField("step_s", "step time (s)")
PIPELINE_COMPUTE = WindowField("pipeline_compute_s", "pipeline compute (s)", pipeline_only=True)
PIPELINE_WAIT = WindowField("pipeline_wait_s", "pipeline wait (s)", pipeline_only=True)
# the forward's token exchanges of expert parallelism (models/parallel/expert_parallel.py), taken out of compute
ALL_TO_ALL = WindowField("all_to_all_s", "expert all-to-all (s)", expert_parallel_only=True)
LOSS = WindowField("loss", "loss")
LOSS_STD = WindowField("loss_std", None)  # the noise the loss verdict measures a departure against
HOST_RSS = WindowField("host_rss_gib", "host memory (GiB)", summary="host RSS, largest rank")
CUDA_PEAK_ALLOCATED = WindowField("cuda_peak_allocated_gib", "CUDA memory, peak allocated (GiB)", cuda_only=True,
                                  summary="CUDA peak allocated, largest rank")
CUDA_PEAK_RESERVED = WindowField("cuda_peak_reserved_gib", "CUDA memory, peak reserved (GiB)", cuda_only=True,
                                 summary="CUDA peak reserved, largest rank")

# in the order of their charts in TensorBoard and their lines in the run summary
FIELDS = (LOSS, STEP, DATA_WAIT, COMPUTE, SYNC_WAIT, HOST_RSS, CUDA_PEAK_ALLOCATED, CUDA_PEAK_RESERVED,
          PIPELINE_COMPUTE, PIPELINE_WAIT, ALL_TO_ALL, LOSS_STD)


def logged_fields(cuda: bool, pipeline: bool, expert_parallel: bool = False) -> tuple[WindowField, ...]:
    """The fields a run on this device, with or without a pipeline and split experts, logs: the others would be
    series of zeros."""
    return tuple(field for field in FIELDS if field.measured_on(cuda, pipeline, expert_parallel))
