"""What a case is (a module configuration, a property's variant, a seed), how hypothesis draws
it, and the tensor values it stands for."""
