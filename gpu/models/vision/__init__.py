"""Vision towers: the image encoders vision-language families put before their projector
(clip.py: LLaVA-1.5's CLIP ViT)."""
