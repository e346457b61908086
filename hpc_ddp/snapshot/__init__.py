"""The code snapshot submit takes (login node; the laptop's side of --ssh too): which files make the project
(git's view, or a walk), their copy and manifest in the run dir, and a snapshot shipped from a laptop."""
