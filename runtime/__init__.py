"""tilemarlin's runtime: tuned tables, compiled-kernel lookup and the torch-facing linear op."""

from .linear import QuantLinear, replace_linear  # noqa: E402
from .op import KernelCheckWarning, w4a8_gemm, w4a16_gemm  # noqa: E402
from .dispatch import UntunedShapeWarning  # noqa: E402
from .artifact import ArtifactError, load_artifact  # noqa: E402
from .checkpoint import CheckpointError, load_quantized  # noqa: E402
