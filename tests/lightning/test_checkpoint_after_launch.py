"""``trainer.save_checkpoint()`` in the launching process after a fork/spawn fit.

The workers held the optimizer states and the loop progress; the launching process only gets
rank 0's (full) weights back. Saving there must say so, and resuming from such a file must say
what it lacks and why, instead of Lightning's ``ModelCheckpoint.save_weights_only`` ``KeyError``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tests.lightning._lit import TinyGPT, dataloader, trainer


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_after_fork_fit_warns_and_resume_explains(tmp_path, state_dict_type):
    from lightning_vescale import VeScaleFSDPStrategy

    def strategy():
        return VeScaleFSDPStrategy(start_method="fork", state_dict_type=state_dict_type)

    pl.seed_everything(0, verbose=False)
    model = TinyGPT()
    t = trainer(strategy(), max_steps=2)
    t.fit(model, dataloader())
    path = tmp_path / "after_fit.ckpt"
    with pytest.warns(UserWarning, match="launching process after a fork/spawn fit.*only "
                                         "the model weights"):
        t.save_checkpoint(path)
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(Exception, match=r"(?s)saved in the launching process after a "
                                        r"fork/spawn fit and holds only model weights"):
        trainer(strategy(), max_steps=4).fit(TinyGPT(), dataloader(), ckpt_path=path)

    # the file holds the trained weights (what the launching process has)
    from lightning_vescale.checkpoint import consolidate

    saved = (torch.load(path, weights_only=True) if state_dict_type == "full"
             else consolidate(path))["state_dict"]
    for k, v in trained.items():
        torch.testing.assert_close(saved[k], v)
