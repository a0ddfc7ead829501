"""The Qwen3-VL vision side: the grid maths of images (:mod:`.grid`), the 3-D rope positions of a
prompt (:mod:`.positions`) and the vision tower (:mod:`.tower`)."""
