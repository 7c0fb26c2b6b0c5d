"""The trust opt-out reaches every Trainer load, and harmless standard types load without it.

Before: ``trainer.fit(model, ckpt_path=..., weights_only=False)`` still refused ``meta.pt``
(Lightning 2.6 drops ``weights_only`` for strategies that restore after setup, design note
[requested-weights-only]), and any ``save_hyperparameters()`` with a ``pathlib.Path`` argument
made a checkpoint that loaded only through that broken opt-out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest

from tests.lightning._lit import SaveAtEnd, TinyGPT, dataloader, trainer


@dataclasses.dataclass
class RunConfig:
    """A user's own class among the hyper-parameters: loading it runs this module's code, so
    ``weights_only=True`` (the default) refuses it."""
    width: int = 32


class HParamsGPT(TinyGPT):
    def __init__(self, data_dir: Path = Path("/data"), config: RunConfig | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters("data_dir", "config")

    def validation_step(self, batch, batch_idx):
        return self.model(*batch)

    def test_step(self, batch, batch_idx):
        return self.model(*batch)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).shape


def _run(fn: str, path: Path, weights_only) -> None:
    from lightning_vescale import VeScaleFSDPStrategy

    t = trainer(VeScaleFSDPStrategy(start_method="fork"), max_steps=4)
    model, data = HParamsGPT(), dataloader()
    kwargs = {} if weights_only is None else {"weights_only": weights_only}
    if fn == "fit":
        t.fit(model, data, ckpt_path=path, **kwargs)
    else:
        getattr(t, fn)(model, data, ckpt_path=path, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two sharded checkpoints after 2 steps: one whose hyper-parameters hold only a
    ``pathlib.Path`` (harmless), one that also holds a ``RunConfig`` (the user's class)."""
    from lightning_vescale import VeScaleFSDPStrategy

    tmp = tmp_path_factory.mktemp("trust")
    out = {}
    for name, config in (("path_only", None), ("user_class", RunConfig())):
        path = tmp / f"{name}.ckpt"
        pl.seed_everything(0, verbose=False)
        t = trainer(VeScaleFSDPStrategy(start_method="fork"), max_steps=2,
                    callbacks=[SaveAtEnd({"sharded": str(path)})])
        t.fit(HParamsGPT(data_dir=tmp, config=config), dataloader())
        out[name] = path
    return out


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_weights_only_false_reaches_the_load(saved, fn):
    with pytest.raises(Exception, match=r"(?s)Refusing to load .*meta\.pt.*RunConfig"):
        _run(fn, saved["user_class"], None)  # safe by default: the user's class is refused
    _run(fn, saved["user_class"], False)  # the opt-out reaches the load: it works


@pytest.mark.parametrize("fn", ["fit", "validate"])
def test_pathlib_hyperparameters_load_by_default(saved, fn):
    _run(fn, saved["path_only"], None)
