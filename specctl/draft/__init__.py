"""The shared draft server (StarSD's M_q): one draft model, many target instances."""
