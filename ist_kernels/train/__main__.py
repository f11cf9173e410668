"""python -m ist_kernels.train: the ist-train command line."""
from .cli import run

if __name__ == "__main__":
    run()
