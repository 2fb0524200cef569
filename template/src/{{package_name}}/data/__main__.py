"""`python -m <package>.data prepare ...`: prepare.py's command line."""

from .prepare import main

if __name__ == "__main__":
    main()
