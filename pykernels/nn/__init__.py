# placeholder: owned by the layer_norm work
