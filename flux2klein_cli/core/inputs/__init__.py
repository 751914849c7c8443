"""A request's inputs, read and sized below the engine: reference images (`images`), the init
image and mask of image-to-image and inpainting (`conditioning`), initial noise files
(`latents`). Each is read with the limits' bounds and prepared exactly as diffusers prepares it;
the plan (core/engine/plan.py) calls them and checks what they give against the model."""
