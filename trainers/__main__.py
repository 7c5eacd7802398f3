"""``python -m trainers``: until the config-driven trainer lands, a short sharded training demo."""

from .demo import main

if __name__ == "__main__":
    main()
