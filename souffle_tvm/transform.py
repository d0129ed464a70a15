"""Souffle's passes where a TVM user looks for them, named and called like ``relax.transform``'s:
each is a ``tvm.transform.Pass`` on a Relax IRModule (module passes, ``souffle.*`` names).

``SoufflePipeline`` is all of them for a level; inside ``tvm.compile`` it goes before TVM's own
pipeline (the target is the one ``tvm.compile`` sets):

    from souffle_tvm import transform as souffle

    mod = relax.transform.BindParams("main", weights)(mod)         # or from_onnx's bound constants
    ex = tvm.compile(mod, target, relax_pipeline=tvm.transform.Sequential(
        [souffle.SoufflePipeline(level="v2"), relax.get_pipeline("default")]))

Weights bound into ``main`` as constants stay bound (``main`` takes only its inputs); weights
passed separately (``SoufflePipeline(target, params)``) come out as :func:`params_of`, which the
emitted ``main`` takes after its inputs. Stitched kernels (v3/v4 on CUDA) need
``tir_pipeline=COOPERATIVE_TIR_PIPELINE``; the pipeline warns when it makes them. The same
objects live in ``souffle_tvm.pipeline.passes`` and ``souffle_tvm.build.cooperative``.
"""

from __future__ import annotations

from .build.cooperative import COOPERATIVE_TIR_PIPELINE
from .errors import CooperativeBuildWarning
from .pipeline.options import Options
from .pipeline.passes import (BindWeights, FoldWeights, HorizontalFusion, LowerToTE, PartitionAndEmit, PlantPrefetch,
                              RequireCooperativeLaunch, SoufflePipeline, StitchSubprograms, TwoPhaseReduction,
                              VerticalFusion, info_of, params_of, without_records)

__all__ = ["BindWeights", "COOPERATIVE_TIR_PIPELINE", "CooperativeBuildWarning", "FoldWeights", "HorizontalFusion", "LowerToTE", "Options",
           "PartitionAndEmit", "PlantPrefetch", "RequireCooperativeLaunch", "SoufflePipeline", "StitchSubprograms",
           "TwoPhaseReduction", "VerticalFusion", "info_of", "params_of", "without_records"]
