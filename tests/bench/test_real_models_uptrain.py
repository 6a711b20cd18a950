"""The real-models report's uptrained row: convert once, uptrain in slices, keep each slice's report."""

from kvlab.bench import real_models_uptrain as uptrain
from needs import SHAKESPEARE, STORIES, require_file


def test_slices_resume_to_the_end_and_keep_the_conversions_loss(tmp_path, monkeypatch):
    require_file(STORIES, "../shared/models/stories260K.gguf")
    require_file(SHAKESPEARE, "../shared/data/tinyshakespeare.txt")
    monkeypatch.setenv("KVLAB_REPORT_WORK", str(tmp_path))
    monkeypatch.setattr(uptrain, "STEPS", 4)
    monkeypatch.setattr(uptrain, "SLICE", 2)
    monkeypatch.setattr(uptrain, "BATCH", 2)
    monkeypatch.setattr(uptrain, "BLOCK", 32)
    assert not uptrain.finished() and uptrain.last_report() is None
    first = uptrain.run_slice(str(STORIES), SHAKESPEARE)
    assert first["steps"] == 2 and not first["finished"] and not uptrain.finished()
    second = uptrain.run_slice(str(STORIES), SHAKESPEARE)
    assert second["steps"] == 4 and second["finished"] and uptrain.finished()
    # "before" is the conversion's loss in every slice (OUT's weights change only at the end); the end trained it
    assert second["val_lm_loss_before"] == first["val_lm_loss_before"] != second["val_lm_loss_after"]
    assert (uptrain.model_dir() / "config.json").exists()
