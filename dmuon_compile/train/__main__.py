"""``python -m dmuon_compile.train`` / ``torchrun ... -m dmuon_compile.train``."""

from dmuon_compile.train.cli import main

if __name__ == "__main__":
    main()
