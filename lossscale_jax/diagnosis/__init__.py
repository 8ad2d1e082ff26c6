"""What float16 does to a model's gradients, leaf by leaf, and which loss scale fixes it.

``diagnose(loss_fn, params, batches)`` differentiates the loss twice per batch: in float32
(the reference) and in float16 at a range of loss scales, the way a training step does, and
reports per gradient leaf what float16 loses (entries that underflow to zero, entries that
overflow) with a verdict per leaf and for the model, and the range of initial scales that
neither overflows nor loses more than the least underflow any scale can reach. A host-side
tool, run before training (it is not part of a step); its computation is jitted.

Holds: ``_diagnose`` (``diagnose`` and its passes), ``_report`` (``Diagnosis``,
``LeafDiagnosis``, the verdicts, the table), ``_localizer`` (the per-tap rows,
``TapDiagnosis``, the modules' input taps, and the verdict that names the layer or the code
between two taps), ``_constants`` (the constants the float16 program holds as inf, such as a
``jnp.where`` mask of -1e9: the verdict's fix) and ``_plot`` (``Diagnosis.plot``; the only
module that imports matplotlib, on first use).

May import: what lies below it in the package's order (``engine``, ``policies``, ``taps``,
``access``, the front-end modules, ``layerwise``) and ``errors``.
"""

# SUBNORMAL_BINADES, the verdicts and the histogram's range stay importable here.
from lossscale_jax.diagnosis._diagnose import SUBNORMAL_BINADES as SUBNORMAL_BINADES
from lossscale_jax.diagnosis._diagnose import diagnose
from lossscale_jax.diagnosis._localizer import TapDiagnosis
from lossscale_jax.diagnosis._report import LOG2_MAX as LOG2_MAX
from lossscale_jax.diagnosis._report import LOG2_MIN as LOG2_MIN
from lossscale_jax.diagnosis._report import NO_SCALING as NO_SCALING
from lossscale_jax.diagnosis._report import NOISE as NOISE
from lossscale_jax.diagnosis._report import OVERFLOWS as OVERFLOWS
from lossscale_jax.diagnosis._report import SCALE_NEEDED as SCALE_NEEDED
from lossscale_jax.diagnosis._report import UNDERFLOWS as UNDERFLOWS
from lossscale_jax.diagnosis._report import Diagnosis, LeafDiagnosis

__all__ = ["Diagnosis", "LeafDiagnosis", "TapDiagnosis", "diagnose"]
