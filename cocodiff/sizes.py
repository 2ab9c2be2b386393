"""How the engine splits n items (tokens, heads) over ranks; free of torch, so the simulator shares it."""

__all__ = ["split_sizes"]


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `torch.tensor_split(range(n), parts)`: the first n % parts parts get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
