//! The suite, once per backend compiled in.

zerohop_tests::suite!(tcp, zerohop_tests::harness::Tcp);
zerohop_tests::suite!(shm, zerohop_tests::harness::Shm);
#[cfg(feature = "mock")]
zerohop_tests::suite!(mock, zerohop_tests::harness::Mock);
#[cfg(feature = "cuda-uma")]
zerohop_tests::suite!(uma, zerohop_tests::harness::Uma);
#[cfg(feature = "gpudirect-verbs")]
zerohop_tests::suite!(rdma, zerohop_tests::harness::Rdma);
