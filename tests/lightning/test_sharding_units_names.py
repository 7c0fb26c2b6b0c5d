"""``sharding_units`` entries as users write them: qualified class names match; a submodule
(attribute) name or a name matching nothing is a ``ValueError`` with the fix."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_vescale._lightning.sharding import resolve_sharding_units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 10)


@pytest.mark.parametrize("name", ["torch.nn.Linear", "torch.nn.modules.linear.Linear", "Linear",
                                  nn.Linear])
def test_qualified_class_names_match(name):
    net = Net()
    assert resolve_sharding_units(net, [name]) == [net.blocks[0].fc, net.blocks[1].fc, net.head]


def test_module_path_of_a_user_class_matches():
    net = Net()
    assert resolve_sharding_units(net, [f"{__name__}.Block"]) == list(net.blocks)


def test_submodule_name_suggests_its_class():
    with pytest.raises(ValueError, match=r"'blocks' is a submodule name \(ModuleList of Block\)"
                                         r".*did you mean sharding_units=\['Block'\]\?"):
        resolve_sharding_units(Net(), ["blocks"])
    with pytest.raises(ValueError, match=r"'emb' is a submodule name \(Embedding\).*"
                                         r"sharding_units=\['Embedding'\]"):
        resolve_sharding_units(Net(), ["Block", "emb"])


def test_no_match_lists_the_closest_classes():
    with pytest.raises(ValueError, match=r"'Blok' matches no submodule of Net\. Closest: "
                                         r"\['Block'\]"):
        resolve_sharding_units(Net(), ["Blok"])
    # an entry that matches nothing is an error even when another entry matches
    with pytest.raises(ValueError, match=r"'TransformerBlock' matches no submodule.*Closest: "
                                         r"\['Block'\]"):
        resolve_sharding_units(Net(), ["Block", "TransformerBlock"])
