"""Finding the residual structure of a ResNet from its modules, without editing it and without
relying on names: stages, blocks, each block's shortcut and main branch, and in the main branch the
conv whose filters LOFT partitions, the BN that follows it, the conv that reads it, and the module
whose output ends the branch (where ResIST scales it).

Rules (:func:`find_resnet` describes what they find in a model):

- A **residual block** is a module that is not a plain chain (not an ``nn.Sequential`` without its
  own ``forward``, not an ``nn.ModuleList``/``nn.ModuleDict``) whose **main branch** holds at least
  two ``Conv2d``.
- Its **shortcut** is the direct child that is a container holding exactly one ``Conv2d``, of
  kernel 1x1, and otherwise only norms, pooling, dropout or identities (a projection: ``shortcut``
  of this package's models and of Hugging Face's ``ResNetShortCut``, torchvision's ``downsample``);
  none, or an ``nn.Identity``, is the identity shortcut. If several children look like one, the one
  reading the block's input width and writing its output width is taken. The **main branch** is
  every other child, walked depth-first in registration order; its ``Conv2d`` and norm modules in
  that order give the LOFT chain (the first conv, the ``BatchNorm2d`` right after it, the conv
  right after that) and the branch's end (the last conv or norm: ``bn2`` of a post-activation basic
  block, ``conv2`` of a pre-activation one, the last ``ResNetConvLayer``'s ``normalization`` of
  Hugging Face's layers).
- A **stage** is an innermost ``nn.Sequential`` or ``nn.ModuleList`` whose items are all residual
  blocks; stages are counted from 1 in module order (``layer1..layer4`` of torchvision's and this
  package's ResNets, ``resnet.encoder.stages.<i>.layers`` of Hugging Face's ``ResNetModel``).
- Models where no stage is found that way but which have children ``layer1``, ``layer2``, ...
  (``nn.Sequential``) are read from those names as before (their blocks are marked
  ``residual=False``: nothing checked that they add a residual).

A block's ``name`` is its full module path, which the plans use as the state-dict prefix of its
tensors; the paths of its layers are relative to the block (``"conv1"``, ``"layer.0.convolution"``).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
# what a projection shortcut may hold besides its one 1x1 conv
_SHORTCUT_EXTRAS = _NORMS + (nn.Identity, nn.AvgPool2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d,
                             nn.Dropout, nn.Sequential)


@dataclass(frozen=True)
class Block:
    """One residual block: ``name`` is its module path (``"layer2.1"``,
    ``"resnet.encoder.stages.2.layers.3"``); ``stage`` counts from 1, ``index`` from 0 within the
    stage; ``stage_path`` is the stage container's path. ``shortcut``: the path (relative to the
    block) of its projection shortcut, None for the identity; ``branch``: the relative paths of the
    main branch's convs and norms in order; ``residual``: found from structure (False: a
    ``layerN`` item read by name only)."""

    name: str
    module: nn.Module
    stage: int
    index: int
    strided: bool
    stage_path: str = ""
    shortcut: Optional[str] = None
    branch: Tuple[str, ...] = ()
    residual: bool = True

    @property
    def partitionable(self) -> bool:
        """LOFT and pruning leave the first block of each stage and strided blocks whole (paper 000
        §4, §6)."""
        return self.index > 0 and not self.strided

    @property
    def tail(self) -> Optional[str]:
        """The module whose output ends the main branch (its last conv or norm), or None."""
        return self.branch[-1] if self.branch else None


def _plain_chain(m: nn.Module) -> bool:
    """A container that cannot add a residual: its forward is nn.Sequential's, or it has none."""
    if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return True
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _walk(children: Sequence[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(relative path, module) of the convs and norms under ``children``, depth-first."""
    out = []
    for cname, child in children:
        for sub, m in child.named_modules(prefix=cname):
            if isinstance(m, (nn.Conv2d,) + _NORMS):
                out.append((sub, m))
    return out


def _projection(m: nn.Module) -> Optional[nn.Conv2d]:
    """The one 1x1 conv of a shortcut-like container, or None."""
    if not m._modules:  # a bare layer is part of the main branch
        return None
    convs = [x for x in m.modules() if isinstance(x, nn.Conv2d)]
    if len(convs) != 1 or tuple(convs[0].kernel_size) != (1, 1):
        return None
    for x in m.modules():
        if x is m or x is convs[0]:
            continue
        if not isinstance(x, _SHORTCUT_EXTRAS) and (x._modules or any(True for _ in x.parameters(recurse=False))):
            return None
    return convs[0]


def _width_in(item: nn.Module) -> Optional[int]:
    if isinstance(item, nn.Conv2d):
        return item.in_channels
    return getattr(item, "num_features", None) or getattr(item, "num_channels", None)


def _analyse(block: nn.Module) -> Optional[Tuple[Optional[str], Tuple[str, ...]]]:
    """(shortcut path or None, main-branch conv/norm paths) of a residual block; None if
    ``block`` is not one."""
    if _plain_chain(block):
        return None
    children = [(n, c) for n, c in block._modules.items() if c is not None]
    candidates = [(n, _projection(c)) for n, c in children]
    candidates = [(n, conv) for n, conv in candidates if conv is not None]

    def main_of(skip: Optional[str]):
        return _walk([(n, c) for n, c in children if n != skip])

    if len(candidates) > 1:  # keep the ones reading the block's input and writing its output
        fitting = []
        for n, conv in candidates:
            main = main_of(n)
            convs = [m for _, m in main if isinstance(m, nn.Conv2d)]
            if convs and conv.in_channels == _width_in(main[0][1]) and conv.out_channels == convs[-1].out_channels:
                fitting.append((n, conv))
        candidates = fitting if len(fitting) == 1 else []
    shortcut = candidates[0][0] if candidates else None
    main = main_of(shortcut)
    if sum(isinstance(m, nn.Conv2d) for _, m in main) < 2:
        return None
    return shortcut, tuple(n for n, _ in main)


def _strided(block: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) and tuple(m.stride) != (1, 1) for m in block.modules())


WHAT = ("an nn.Sequential or nn.ModuleList whose items are all residual blocks (modules, not plain "
        "nn.Sequential chains, with >= 2 Conv2d in their main branch besides an optional 1x1-conv "
        "shortcut)")


def stages(model: nn.Module, who: str) -> List[List[Block]]:
    """The blocks of ``model``'s residual stages, found from structure (module docstring); a clear
    error if there are none."""
    analysed: Dict[int, Optional[Tuple[Optional[str], Tuple[str, ...]]]] = {}

    def analyse(m: nn.Module):
        if id(m) not in analysed:
            analysed[id(m)] = _analyse(m)
        return analysed[id(m)]

    candidates = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) > 0 and \
                all(c is not None and analyse(c) is not None for c in m._modules.values()):
            candidates.append((path, m))
    paths = [p for p, _ in candidates]
    innermost = [(p, m) for p, m in candidates
                 if not any(q != p and (p == "" or q.startswith(p + ".")) for q in paths)]
    found: List[List[Block]] = []
    for i, (path, stage) in enumerate(innermost, 1):
        blocks = []
        for j, (key, block) in enumerate(stage._modules.items()):
            shortcut, branch = analyse(block)
            name = f"{path}.{key}" if path else key
            blocks.append(Block(name, block, i, j, _strided(block), path, shortcut, branch, True))
        found.append(blocks)
    if found:
        return found
    return _stages_by_name(model, who)


def _stages_by_name(model: nn.Module, who: str) -> List[List[Block]]:
    """Children ``layer1``, ``layer2``, ... (nn.Sequential of blocks) read by name, for models whose
    blocks are not recognised as residual (the package's behaviour before structural search)."""
    children = dict(model.named_children())
    found = []
    i = 1
    while f"layer{i}" in children:
        stage = children[f"layer{i}"]
        if not isinstance(stage, nn.Sequential) or len(stage) == 0:
            raise ValueError(f"{who}: expected model.layer{i} to be a non-empty nn.Sequential of "
                             f"residual blocks, got {type(stage).__name__}")
        blocks = []
        for j, block in enumerate(stage):
            branch = tuple(n for n, _ in _walk([(k, c) for k, c in block._modules.items() if c is not None]))
            blocks.append(Block(f"layer{i}.{j}", block, i, j, _strided(block), f"layer{i}", None,
                                branch, False))
        found.append(blocks)
        i += 1
    if not found:
        raise ValueError(f"{who}: expected a ResNet with residual stages, i.e. {WHAT}, or children "
                         f"layer1, layer2, ... (nn.Sequential of blocks); found none in "
                         f"{type(model).__name__}")
    return found


def filter_layers(block: Block, who: str) -> Tuple[str, str, str]:
    """Paths, relative to the block, of ``(filter_conv, bn, next_conv)``: the main branch's first
    conv, the ``BatchNorm2d`` right after it (on its output filters), the conv right after that
    (reading those channels)."""
    mods = dict(block.module.named_modules())
    seq = [(n, mods[n]) for n in block.branch]
    c = next((k for k, (_, m) in enumerate(seq) if isinstance(m, nn.Conv2d)), None)
    ok = c is not None and c + 2 < len(seq) and isinstance(seq[c + 1][1], nn.BatchNorm2d) and \
        isinstance(seq[c + 2][1], nn.Conv2d)
    if not ok:
        raise ValueError(f"{who}: block {block.name} ({type(block.module).__name__}) has no "
                         f"Conv2d -> BatchNorm2d -> Conv2d in its main branch to partition by "
                         f"filters (found: {', '.join(f'{n} ({type(m).__name__})' for n, m in seq) or 'nothing'})")
    (cn, conv), (bn_name, bn), (nn_name, nxt) = seq[c], seq[c + 1], seq[c + 2]
    if not (conv.out_channels == bn.num_features == nxt.in_channels) or conv.groups != 1 or nxt.groups != 1:
        raise ValueError(
            f"{who}: block {block.name}: {cn} ({conv.out_channels} filters), {bn_name} "
            f"({bn.num_features} channels) and {nn_name} ({nxt.in_channels} input channels) must "
            f"match, with groups=1")
    return cn, bn_name, nn_name


def skippable(block: Block) -> bool:
    """A block a shallower network can leave out: not strided and an identity shortcut."""
    if block.strided:
        return False
    if block.residual:
        return block.shortcut is None
    for attr in ("shortcut", "downsample"):  # blocks read by name only
        sc = getattr(block.module, attr, None)
        if isinstance(sc, nn.Module) and any(True for _ in sc.parameters()):
            return False
    return True


def has_scale_attribute(block: Block) -> bool:
    """The block scales its own residual branch (a float ``residual_scale``, ``ist_kernels.models``)."""
    return isinstance(getattr(block.module, "residual_scale", None), float)


# ---- what each method needs ----------------------------------------------------------------------

def loft_blocks(model: nn.Module, who: str) -> List[Tuple[Block, Tuple[str, str, str]]]:
    """The blocks LOFT and filter pruning partition (not the first of a stage, not strided) with
    their (filter conv, BN, next conv) paths; errors if there is none or one cannot be read."""
    blocks = [b for stage in stages(model, who) for b in stage if b.partitionable]
    if not blocks:
        raise ValueError(f"{who}: the model has no partitionable block (every block is the first "
                         f"of its stage or strided)")
    return [(b, filter_layers(b, who)) for b in blocks]


def resist_blocks(model: nn.Module, who: str) -> Tuple[List[Block], List[Block]]:
    """(the third stage, its blocks after the first that ResIST deals out: unstrided, identity
    shortcut); errors if the model has fewer than three stages, no such block, or one whose
    residual branch the full model cannot scale."""
    all_stages = stages(model, who)
    if len(all_stages) < 3:
        raise ValueError(f"{who}: expected a ResNet with at least three stages (found "
                         f"{len(all_stages)}: {', '.join(s[0].stage_path for s in all_stages)})")
    stage = all_stages[2]
    part = [b for b in stage[1:] if skippable(b)]
    if not part:
        raise ValueError(f"{who}: the third stage ({stage[0].stage_path}) has no block after its "
                         f"first that can be skipped (unstrided, identity shortcut)")
    for b in part:
        if has_scale_attribute(b):
            continue
        if not b.residual:
            raise ValueError(
                f"{who}: block {b.name} ({type(b.module).__name__}) has no float attribute "
                f"residual_scale and is not a residual block found from its structure; the full "
                f"model must scale partitioned blocks' output at evaluation (paper 003 §2.6)")
        if b.tail is None:
            raise ValueError(f"{who}: block {b.name} has no conv or norm ending its main branch "
                             f"to scale at evaluation (paper 003 §2.6)")
    return stage, part


@dataclass(frozen=True)
class ResNetDescription:
    """What :func:`find_resnet` found: the stages (paths and blocks), the blocks LOFT / pruning
    partition with their (filter conv, BN, next conv), the blocks ResIST deals out (or why not)."""

    stages: Tuple[Tuple[Block, ...], ...]
    loft: Dict[str, Tuple[str, str, str]]
    resist: Tuple[str, ...]
    loft_error: Optional[str] = None
    resist_error: Optional[str] = None

    @property
    def stage_paths(self) -> List[str]:
        return [s[0].stage_path for s in self.stages]

    def __str__(self) -> str:
        """One line per stage, a tag per block: L (LOFT partitions it), R (ResIST deals it out),
        LR (both), - (shared whole)."""
        lines = []
        for s in self.stages:
            tags = " ".join(("L" if b.name in self.loft else "") + ("R" if b.name in self.resist else "") or "-"
                            for b in s)
            lines.append(f"stage {s[0].stage}: {s[0].stage_path} ({len(s)} x {type(s[0].module).__name__}) [{tags}]")
        lines.append(f"loft: {len(self.loft)} partitionable blocks" if self.loft_error is None
                     else f"loft: {self.loft_error}")
        lines.append(f"resist: {len(self.resist)} blocks dealt out" if self.resist_error is None
                     else f"resist: {self.resist_error}")
        return "\n".join(lines)


def find_resnet(model: nn.Module, method: Optional[str] = None) -> ResNetDescription:
    """Describe the residual structure LOFT / ResIST / filter pruning find in ``model`` (stages,
    partitionable and skippable blocks). With ``method`` (``"loft"``, ``"prune"`` or
    ``"resist"``) raise the ValueError that method's plan would raise on this model, so a trainer
    can check a user's model before launching; without it only the absence of any stage raises."""
    if method not in (None, "loft", "prune", "resist"):
        raise ValueError(f"find_resnet: method must be 'loft', 'prune', 'resist' or None, got {method!r}")
    who = {None: "find_resnet", "loft": "loft_plan", "prune": "prune_filters", "resist": "resist_plan"}[method]
    found = tuple(tuple(s) for s in stages(model, who))
    loft: Dict[str, Tuple[str, str, str]] = {}
    resist: Tuple[str, ...] = ()
    errors: Dict[str, Optional[str]] = {"loft": None, "resist": None}
    try:
        loft = {b.name: layers for b, layers in loft_blocks(model, who if method in ("loft", "prune") else "loft_plan")}
    except ValueError as e:
        if method in ("loft", "prune"):
            raise
        errors["loft"] = str(e)
    try:
        resist = tuple(b.name for b in resist_blocks(model, who if method == "resist" else "resist_plan")[1])
    except ValueError as e:
        if method == "resist":
            raise
        errors["resist"] = str(e)
    return ResNetDescription(found, loft, resist, errors["loft"], errors["resist"])
