"""Print the value to pass to ``--user-dir`` for the installed package.

    fairseq-train --user-dir "$(python -m sut_fairseq.user_dir)" ...
"""
import os


def user_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


if __name__ == "__main__":
    print(user_dir())
