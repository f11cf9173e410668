"""What the grid experiments share: running every cell of a grid, optionally in processes."""
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Dict, Sequence


def _call(job):
    fn, args, cell = job
    return fn(args, cell)


def run_grid(run_cell: Callable, args, cells: Sequence, desc: str, jobs: int = 1) -> Dict:
    """{cell: run_cell(args, cell)} for every cell, with a progress bar; ``jobs`` > 1 runs the
    cells in that many processes (run_cell must then be a module-level function)."""
    from tqdm import tqdm

    results = {}
    with tqdm(total=len(cells), desc=desc, file=sys.stderr) as bar:
        if jobs <= 1:
            for c in cells:
                results[c] = run_cell(args, c)
                bar.update()
        else:
            with ProcessPoolExecutor(jobs) as pool:
                for c, r in zip(cells, pool.map(_call, [(run_cell, args, c) for c in cells])):
                    results[c] = r
                    bar.update()
    return results
