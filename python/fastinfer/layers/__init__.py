"""Model building blocks on the fastinfer ops: linear layers with pluggable linear methods (float
here; fp8 / int4 in :mod:`fastinfer.quant`), RMSNorm, embedding / LM head, paged attention, the
mixture-of-experts MLP, the forward batch and its builder, and the checkpoint readers layers load
their own weights from.

Every layer takes the op backend it calls (``ops=fastinfer.ops.backend(...)``) and, for weights, the
checkpoint names it loads (``prefix``). Tensor parallel: a layer built with a
:class:`~fastinfer.distributed.ParallelInfo` holds and loads its rank's shard (column / row / vocabulary
parallel) and meets the other ranks in its collectives.
"""

from .attention import KVCache, PagedAttention  # noqa: F401
from .batch import BatchBuilder, ForwardBatch, host_to_device, slot_of  # noqa: F401
from .embedding import LMHead, VocabEmbedding  # noqa: F401
from .linear import (  # noqa: F401
    ColumnParallelLinear,
    Linear,
    LinearMethod,
    ParallelInfo,
    QuantizationConfig,
    QuantizedInput,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    WeightPart,
    param,
)
from .moe import (  # noqa: F401
    ExpertProjections,
    FusedMoE,
    FusedMoEMethod,
    RouterMethod,
    StackedExpertsReader,
    UnquantizedFusedMoEMethod,
)
from .norm import RMSNorm  # noqa: F401
from .weights import (  # noqa: F401
    CheckpointModule,
    SafetensorsReader,
    TensorDictReader,
    WeightReader,
    check_tensor,
    checkpoint_files,
)

__all__ = [
    "BatchBuilder", "ForwardBatch", "host_to_device", "slot_of",
    "CheckpointModule", "WeightReader", "SafetensorsReader", "TensorDictReader", "checkpoint_files", "check_tensor",
    "Linear", "LinearMethod", "QuantizedInput", "UnquantizedLinearMethod", "QuantizationConfig", "WeightPart", "ParallelInfo",
    "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "param",
    "RMSNorm", "VocabEmbedding", "LMHead", "PagedAttention", "KVCache",
    "FusedMoE", "FusedMoEMethod", "UnquantizedFusedMoEMethod", "RouterMethod", "ExpertProjections",
    "StackedExpertsReader",
]
