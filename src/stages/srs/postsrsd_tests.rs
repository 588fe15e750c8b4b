//! Against the real postsrsd.
