"""Small-scale reproductions of the papers' experiments; run ``python -m ist_kernels.experiments NAME``.
Needs the ``[experiments]`` extra: without numpy or tqdm the import fails with one line saying so."""
from .._extras import require

require(__name__, "experiments", ["numpy", "tqdm"])  # what its modules import; the rest when used
