"""Vision towers: the image encoders vision-language families put before their projector
(clip.py: LLaVA-1.5's CLIP ViT; qwen2_vl.py: Qwen2-VL's and Qwen2.5-VL's, with segments.py for
attention within each frame or window)."""
