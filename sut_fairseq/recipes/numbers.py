"""Sets of integers written on a command line: ``"7..12"``, ``"1-4"``, ``"7,9,12"`` or a
mix (``"1-3,5"``), e.g. the test buckets or hops a recipe evaluates."""
from typing import List


def parse_numbers(text: str) -> List[int]:
    """The sorted integers ``text`` names; ``ValueError`` naming ``text`` when it names
    none or holds something that is not an integer or a range ``A..B`` / ``A-B``."""
    numbers = set()
    try:
        for part in text.split(","):
            part = part.strip()
            for sep in ("..", "-"):
                if sep in part.lstrip("-"):
                    low, high = part.split(sep, 1) if sep == ".." else part.rsplit(sep, 1)
                    numbers.update(range(int(low), int(high) + 1))
                    break
            else:
                numbers.add(int(part))
    except ValueError:
        raise ValueError(f"expected integers or ranges such as 7..12, 1-4 or 7,9,12; got {text!r}") from None
    if not numbers:
        raise ValueError(f"{text!r} names no number (a range A..B needs A <= B)")
    return sorted(numbers)
