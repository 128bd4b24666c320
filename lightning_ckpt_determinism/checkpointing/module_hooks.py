"""The hooks registered on modules, held as they are and put back: a forward or a training step that registers a
hook once (behind an attribute it creates, as transformers' output capturing does) must not register it a second time
where the package replays or restores that attribute."""

from collections.abc import Sequence
from typing import Any

from lightning_ckpt_determinism._torch_compat import hook_dicts, hook_handles_made

__all__ = ["HookSnapshot", "hooks_added_since"]


class HookSnapshot:
    """The forward, backward and state-dict hooks of some modules, as they are now; :meth:`restore` puts them back
    (those registered since removed, those removed since back, in their order), any number of times.

    Args:
        attributes: The modules' attribute dicts (``vars(module)``).

    Example::

        >>> import torch
        >>> layer, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
        >>> hooks, before = HookSnapshot([vars(layer)]), layer(x)
        >>> _ = layer.register_forward_hook(lambda module, inputs, output: output * 2)
        >>> hooks.restore()
        >>> torch.equal(layer(x), before)
        True
    """

    __slots__ = ("_held", "_made")

    def __init__(self, attributes: Sequence[dict[str, Any]]) -> None:
        self._made = hook_handles_made()
        # Every dictionary, empty ones too: a hook removed since from one that holds none now comes back.
        self._held = [(hooks, dict(hooks)) for held in attributes for hooks in hook_dicts(held)]

    def restore(self) -> None:
        """Put the hooks back as they were when the snapshot was taken."""
        if hook_handles_made() == self._made and all(len(hooks) == len(held) for hooks, held in self._held):
            return  # nothing registered (that moves the count) nor removed (that shrinks a dictionary) since
        for hooks, held in self._held:
            if hooks.keys() != held.keys():
                hooks.clear()
                hooks.update(held)


def hooks_added_since(attributes: Sequence[dict[str, Any]], made: int) -> list[tuple[dict[int, Any], list[int]]]:
    """The hook dictionaries of these modules that hold hooks registered since :func:`hook_handles_made` gave ``made``,
    with those hooks' ids.

    Example::

        >>> import torch
        >>> from lightning_ckpt_determinism._torch_compat import hook_handles_made
        >>> layer, made = torch.nn.Linear(2, 2), hook_handles_made()
        >>> handle = layer.register_forward_pre_hook(lambda module, inputs: None)
        >>> [ids == [handle.id] for _, ids in hooks_added_since([vars(layer)], made)]
        [True]
    """
    added = []
    for held in attributes:
        for hooks in hook_dicts(held):
            ids = [key for key in hooks if key >= made]
            if ids:
                added.append((hooks, ids))
    return added
