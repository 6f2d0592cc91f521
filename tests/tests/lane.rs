//! The same-host lane against a peer that writes its frames by hand
//! (`LaneRig`): a frame naming device memory, to a lane that carries none,
//! is a typed protocol error that ends that lane, and nothing is held after.

use zerohop_core::session::ProtocolError;
use zerohop_core::wire::{Data, DataFlags, Frame, Hello, Takes};
use zerohop_core::Error;
use zerohop_std::shm::testing::LaneRig;

fn hello() -> [u8; 32] {
    Frame::Hello(Hello {
        window: 1 << 20,
        max_message: 1 << 20,
        frame_max: 1 << 20,
        ring: 0,
        lane: 0,
        takes: Takes::NONE,
        token: 9,
    })
    .encode(&[])
}

fn data(flags: DataFlags, seq: u64, len: u32) -> [u8; 32] {
    Frame::Data(Data {
        flags,
        seq,
        msg_len: len,
        len,
        offset: 0,
        credits: 0,
    })
    .encode(&[])
}

#[test]
fn a_device_frame_to_a_lane_without_a_gpu_ends_that_lane_typed() {
    let mut rig = LaneRig::new(1 << 16, 1 << 20).unwrap();
    rig.peer_write(&hello());
    rig.peer_write(&data(DataFlags::NONE, 0, 5));
    rig.peer_write(b"hello");
    rig.read().unwrap();
    assert_eq!(rig.take_delivered(), [Ok(5)], "a host message first");
    // A device message: its header, then the descriptor a GPU peer writes.
    rig.peer_write(&data(DataFlags::DEVICE, 1, 32 << 10));
    rig.peer_write(&[0u8; 88]);
    match rig.read() {
        Err(Error::Protocol { error, .. }) => assert_eq!(error, ProtocolError::DeviceRefused),
        other => panic!("expected DeviceRefused, got {other:?}"),
    }
    assert!(!rig.alive(), "the lane ended");
    assert_eq!(rig.read(), Err(Error::Closed), "and takes nothing more");
    assert!(
        rig.take_delivered().is_empty(),
        "nothing of the device frame delivered"
    );
    assert_eq!(rig.pool_used(), 0, "no receive buffer held");
}
