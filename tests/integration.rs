//! The integration tests: one test binary, so one throwaway PostgreSQL cluster serves
//! them all (see `util::pg`). Every test gets its own database.

mod suite;
mod util;
